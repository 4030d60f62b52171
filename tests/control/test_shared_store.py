"""Several controllers on one store lose nothing and fail nothing of one another's (issue 20):
each workload and job names the controller that runs it, so a controller that starts fails only
its own leftovers and the leader those of a controller gone for good (`follow.Orphans`); one admin
key however many controllers start at once; no key rotation while other controllers run; only the
leader prunes usage; no `--recover` on PostgreSQL; the epoch of `/version` is the leadership's;
forwarded requests and the role are counted; a node's rotated keys reach the other controllers;
time is the store's: a controller whose clock runs ahead neither takes the lease early nor fails the
leader's live work (issue 30 point 9).

Two `Store`s on one PostgreSQL database stand for two controllers (tests/support/postgres.py).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from nexa import security
from nexa.channel import links
from nexa.config import ClusterConfig, GatewayConfig, Seconds, StoreConfig
from nexa.contracts.domain import SYSTEM
from nexa.contracts.evidence import JobKind, JobState
from nexa.contracts.gateway import WorkloadState
from nexa.contracts.wire import RotateKeys
from nexa.control import store as st
from nexa.control.access.accounts import Accounts
from nexa.control.cluster.follow import LIVE_LEASES, Orphans, gone, other_live_controllers
from nexa.control.cluster.forward import FORWARDED_HEADER, Forwarder
from nexa.control.cluster.leadership import Leadership
from nexa.control.datapath.metering import FIRST_PRUNE_S, PRUNE_INTERVAL_S, Meter
from nexa.control.datapath.workloads import LOST, RESTARTED, Workloads
from nexa.control.fleet import keyring
from nexa.control.operations.jobs import Jobs
from nexa.control.operations.recovery import refuse_forced
from nexa.control.service import KEYS_DIR, serve_control
from nexa.errors import ConfigError, Conflict, ControllersRunning
from nexa.security import SigningKey, generate_signing_key, verify_receipt
from nexa.telemetry import Metrics
from tests.conftest import start_controller
from tests.support.follow import cluster_config, enroll, two_sides, until_leads
from tests.support.postgres import pg_url_fixture, postgres_fixture, psql  # noqa: F401 - fixtures
from tests.support.usage import stored_count, usage_record
from tests.support.workloads import ACME, begin, receipt_for

LEASE_S = 2.0


@pytest.fixture
def signer() -> SigningKey:
    return generate_signing_key()


@pytest.fixture
async def pair(tmp_path: Path, pg_url: str) -> AsyncIterator[tuple[st.Store, st.Store]]:
    """Two controllers' stores on one PostgreSQL database."""
    cfg = StoreConfig(url=pg_url)
    async with st.open_store(tmp_path / "a", cfg) as a, st.open_store(tmp_path / "b", cfg) as b:
        yield a, b


def controller_row(name: str, seen_at: float) -> st.ControllerRow:
    return st.ControllerRow(
        id=name, address=f"http://{name}.test", role="follower", epoch=0, started_at=0.0, seen_at=seen_at
    )


def write_seen(db: st.Db, row: st.ControllerRow) -> None:
    """A controller's row as if it was last written at `row.seen_at` (the store stamps its own time)."""
    st.save_controller(db, row)
    db.execute("UPDATE controller SET seen_at = ? WHERE id = ?", (row.seen_at, row.id))


async def unfinished(store: st.Store) -> dict[str, str | None]:
    return {row.accepted.workload_id: row.controller for row in await store.run(st.unfinished_workloads)}


# ---- 1. who runs each workload and job ----------------------------------------------------------------------------


async def test_a_starting_controller_fails_only_its_own_unfinished_workloads(
    pair: tuple[st.Store, st.Store], signer: SigningKey
) -> None:
    a_store, b_store = pair
    a = await Workloads.load(a_store, signer, controller="a")
    b = await Workloads.load(b_store, signer, controller="b", epoch=lambda: 7)
    await begin(a, workload_id="wa", key="ka")
    await begin(b, workload_id="wb", key="kb")
    assert await unfinished(a_store) == {"wa": "a", "wb": "b"}

    # b restarts: its own workload is failed, a's live one runs on.
    b = await Workloads.load(b_store, signer, controller="b", epoch=lambda: 7)
    assert await unfinished(a_store) == {"wa": "a"}
    with pytest.raises(Conflict, match="runs on another controller"):
        await b.cancel(ACME, "wa")  # its call lives on a
    receipt = await b.receipt(ACME, "wb")
    verify_receipt(signer.public, receipt)
    assert (receipt.receipt.state, receipt.receipt.error) == (WorkloadState.FAILED, RESTARTED)
    assert receipt.receipt.controller_epoch == 7  # the leadership's epoch, not the store's

    # A row that names no controller (written before they were named) is failed only by a
    # controller that starts with no other one running (`unowned`).
    old = Workloads(a_store, signer)  # no controller named on what it records
    await begin(old, workload_id="w0", key="k0")
    await Workloads.load(b_store, signer, controller="b")
    assert await unfinished(a_store) == {"wa": "a", "w0": None}
    await Workloads.load(b_store, signer, controller="b", unowned=True)
    assert await unfinished(a_store) == {"wa": "a"}


async def test_the_leader_fails_what_a_gone_controller_left_unfinished(
    pair: tuple[st.Store, st.Store], signer: SigningKey
) -> None:
    a_store, b_store = pair
    leader = await Workloads.load(a_store, signer, controller="a", epoch=lambda: 4)
    dead = await Workloads.load(b_store, signer, controller="b")
    live = await Workloads.load(b_store, signer, controller="c")
    lost = await begin(dead, workload_id="wb", key="kb")
    await begin(live, workload_id="wc", key="kc")
    dead_jobs, live_jobs = Jobs(b_store, Metrics(), controller="b"), Jobs(b_store, Metrics(), controller="c")
    dead_backup = await dead_jobs.record(JobKind.BACKUP, "backup")
    live_backup = await live_jobs.record(JobKind.BACKUP, "backup")

    now = time.time()
    await a_store.run(write_seen, controller_row("a", now))
    await a_store.run(write_seen, controller_row("b", now - LIVE_LEASES * LEASE_S - 1))
    await a_store.run(write_seen, controller_row("c", now - LEASE_S))  # late, not gone
    assert gone(await a_store.run(st.list_controllers), "a", now=now, lease_s=LEASE_S).keys() == {"b"}

    jobs = Jobs(a_store, Metrics(), controller="a")
    orphans = Orphans(
        a_store, ClusterConfig(lease_s=Seconds(LEASE_S), renew_s=Seconds(0.5)), controller_id="a", parts=(leader, jobs)
    )
    assert await orphans.sweep() == 2  # b's workload and b's backup
    assert await unfinished(a_store) == {"wc": "c"}
    receipt = await leader.receipt(ACME, "wb")
    verify_receipt(signer.public, receipt)
    assert (receipt.receipt.error, receipt.receipt.controller_epoch) == (LOST, 4)
    assert (await jobs.get(dead_backup)).state is JobState.FAILED
    assert (await jobs.get(live_backup)).state is JobState.RUNNING
    assert await orphans.sweep() == 0  # swept once while b stays gone
    unnamed = await begin(Workloads(b_store, signer), workload_id="w0", key="k0")
    await a_store.run(write_seen, controller_row("c", now - LIVE_LEASES * LEASE_S - 1))
    assert await orphans.sweep() == 3  # c gone too: its work, and what names no controller
    assert await unfinished(a_store) == {}
    assert (await leader.receipt(ACME, unnamed.accepted.workload_id)).receipt.error == LOST

    # b was only cut off: its call ends after all. Its receipt is returned, the stored one stays.
    late = await dead.finish(lost, receipt_for(lost))
    assert late.receipt.state is WorkloadState.SUCCEEDED
    assert (await leader.receipt(ACME, "wb")) == receipt
    # b starts again: nothing of its own is left to fail, and nothing fails.
    await Workloads.load(b_store, signer, controller="b", unowned=True)
    assert await Jobs(b_store, Metrics(), controller="b").fail_interrupted(unowned=True) == 0


async def test_a_starting_controller_fails_only_its_own_interrupted_backups(pair: tuple[st.Store, st.Store]) -> None:
    a_store, b_store = pair
    a, b = Jobs(a_store, Metrics(), controller="a"), Jobs(b_store, Metrics(), controller="b")
    a_backup, b_backup = await a.record(JobKind.BACKUP, "backup a"), await b.record(JobKind.BACKUP, "backup b")
    assert await Jobs(b_store, Metrics(), controller="b").fail_interrupted() == 1
    assert (await a.get(a_backup)).state is JobState.RUNNING
    assert (await a.get(b_backup)).state is JobState.FAILED
    # The embedded store's only controller (None) fails every one, as before.
    assert await Jobs(a_store, Metrics()).fail_interrupted() == 1
    assert (await a.get(a_backup)).state is JobState.FAILED


# ---- 2. one admin key ----------------------------------------------------------------------------------------------


async def test_two_controllers_starting_at_once_on_an_empty_store_create_one_admin_key(
    pair: tuple[st.Store, st.Store],
) -> None:
    accounts_pair = [await Accounts.load(store, Metrics()) for store in pair]
    secrets: list[str | None] = []

    async def ensure(accounts: Accounts) -> None:
        secrets.append(await accounts.ensure_admin_key(None))

    async with trio.open_nursery() as nursery:
        for accounts in accounts_pair:
            nursery.start_soon(ensure, accounts)
    [secret] = [s for s in secrets if s is not None]
    assert len(secrets) == 2
    [key] = await pair[0].run(st.load_keys)
    assert [e.action for e in await pair[0].run(st.list_audit, st.AuditQuery())] == ["key.create"]
    for accounts in accounts_pair:  # both know it (the one that lost read it back)
        assert accounts.authenticate(secret).id == key.id


# ---- 3. no controller key rotation while others run ----------------------------------------------------------------


async def test_a_controller_key_rotation_is_refused_while_other_controllers_run(
    tmp_path: Path, pair: tuple[st.Store, st.Store]
) -> None:
    store, _ = pair
    keys_dir = tmp_path / "keys"
    keys = keyring.load_or_create_keys(keys_dir)
    before = {p.name: p.read_bytes() for p in keys_dir.iterdir()}
    accounts = await Accounts.load(store, Metrics())
    announced: list[int] = []

    async def announce(_keys: keyring.ControllerKeys, _old: security.SigningKey, _until: float) -> int:
        announced.append(1)
        return 0

    rotation = keyring.KeyRotation(
        keys_dir,
        keys,
        overlap_s=60.0,
        accounts=accounts,
        announce=announce,
        others=lambda: other_live_controllers(store, "a", LEASE_S),
        others_gone_after_s=LIVE_LEASES * LEASE_S,
    )
    now = time.time()
    await store.run(write_seen, controller_row("a", now))
    await store.run(write_seen, controller_row("b", now))
    head = await store.run(st.audit_head)
    with pytest.raises(ControllersRunning) as refused:
        await rotation.rotate(SYSTEM)
    assert refused.value.others == ["b"]
    assert "copy this controller's <state_dir>/keys" in refused.value.message
    assert {p.name: p.read_bytes() for p in keys_dir.iterdir()} == before  # nothing changed
    assert (rotation.keys, announced, await store.run(st.audit_head)) == (keys, [], head)

    # b stopped long enough ago: this is the only controller left, and it rotates.
    await store.run(write_seen, controller_row("b", now - LIVE_LEASES * LEASE_S - 1))
    rotated = await rotation.rotate(SYSTEM)
    assert rotated.key_id != keys.key_id == rotation.keys.previous.key_id  # type: ignore[union-attr]


# ---- 4. only the leader prunes usage -------------------------------------------------------------------------------


async def test_only_the_leader_prunes_usage(tmp_path: Path, mock_clock: trio.testing.MockClock) -> None:
    now = time.time()
    cfg = GatewayConfig(metering_flush_s=Seconds(1.0), usage_retention_s=Seconds(86400.0))
    leading = False
    async with st.open_store(tmp_path / "state", inline=True) as store, trio.open_nursery() as nursery:
        await store.run(st.insert_usage, [usage_record(finished_at=now - 2 * 86400)])
        await nursery.start(Meter(cfg, store, Metrics(), leading=lambda: leading).run)
        mock_clock.jump(FIRST_PRUNE_S + 1)
        await trio.testing.wait_all_tasks_blocked()
        assert await stored_count(store) == 1  # a follower prunes nothing
        leading = True  # it took the lease: it prunes within a minute, not an hour
        mock_clock.jump(FIRST_PRUNE_S + 1)
        await trio.testing.wait_all_tasks_blocked()
        assert await stored_count(store) == 0
        assert FIRST_PRUNE_S < PRUNE_INTERVAL_S
        nursery.cancel_scope.cancel()


# ---- 5. no --recover on PostgreSQL ---------------------------------------------------------------------------------


async def test_recover_is_refused_on_postgresql_before_anything_is_written(tmp_path: Path, pg_url: str) -> None:
    refuse_forced(True, "sqlite")  # the embedded store recovers as before
    refuse_forced(False, "postgresql")
    cfg = cluster_config(tmp_path, "a", pg_url)
    with pytest.raises(ConfigError, match="restore the PostgreSQL database with its own tools"):
        await serve_control(cfg, stopping=trio.Event(), recover=True)
    assert psql(pg_url, "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'") == [(0,)]


# ---- 6. forwarded requests counted ---------------------------------------------------------------------------------


class _Lead:
    is_leader = False
    leader_address: str | None = "https://leader.test"  # a mock transport answers it
    leader_id: str | None = "a"


async def _post(app: Any, path: str, *headers: tuple[bytes, bytes]) -> int:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-length", b"2"), *headers],
        "client": ("127.0.0.1", 40000),
        "scheme": "http",
    }
    await app(scope, receive, send)
    return int(sent[0]["status"])


async def test_forwarded_requests_are_counted_by_result(nursery: trio.Nursery) -> None:
    def leader(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/v1/gone":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(201, stream=httpx.ByteStream(b"{}"))  # streamed, as from a real leader

    async def local(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("a follower served a write itself")

    metrics, lead = Metrics(), _Lead()
    forwarder = Forwarder(
        local, lead, controller_id="b", max_body_bytes=1024, transport=httpx.MockTransport(leader), metrics=metrics
    )
    await nursery.start(forwarder.run)
    assert await _post(forwarder, "/api/v1/tenants") == 201
    assert await _post(forwarder, "/api/v1/gone") == 503
    assert await _post(forwarder, "/api/v1/tenants", (FORWARDED_HEADER.encode(), b"c")) == 503
    lead.leader_address = None
    assert await _post(forwarder, "/api/v1/tenants") == 503
    counted = {
        result: metrics.registry.get_sample_value("nexa_forwarded_requests_total", {"result": result})
        for result in ("ok", "leader_unreachable", "loop", "no_leader")
    }
    assert counted == {"ok": 1.0, "leader_unreachable": 1.0, "loop": 1.0, "no_leader": 1.0}


# ---- 5, 6 and 3 on two real controllers ----------------------------------------------------------------------------


async def test_two_controllers_show_the_leaders_epoch_their_role_and_refuse_a_key_rotation(
    nursery: trio.Nursery, tmp_path: Path, pg_url: str
) -> None:
    with trio.fail_after(60):
        leader = await start_controller(nursery, cluster_config(tmp_path, "a", pg_url))
        shutil.copytree(leader.state_dir / KEYS_DIR, tmp_path / "b" / "state" / KEYS_DIR)
        follower = await start_controller(nursery, cluster_config(tmp_path, "b", pg_url), admin_key=leader.admin_key)
        async with leader.client() as a, follower.client() as b:
            await until_leads(a)
            for http, role in ((a, 1.0), (b, 0.0)):
                ready = (await http.get("/readyz")).json()
                version = (await http.get("/version")).json()
                assert version["epoch"] == ready["epoch"]  # the lease's (a follower: 0), not the store's
                metrics = (await http.get("/metrics")).text
                assert f"nexa_controller_role {role}" in metrics
            assert (await a.get("/readyz")).json()["epoch"] > 0

            made = await b.post("/api/v1/tenants", json={"id": "acme"})
            assert made.status_code == 201, made.text
            assert 'nexa_forwarded_requests_total{result="ok"} 1.0' in (await b.get("/metrics")).text

            keys = {p.name: p.read_bytes() for p in (leader.state_dir / KEYS_DIR).iterdir()}
            refused = await a.post("/api/v1/controller/rotate-keys")
            assert refused.status_code == 409, refused.text
            assert refused.json()["error"]["code"] == "controllers_running"
            assert {p.name: p.read_bytes() for p in (leader.state_dir / KEYS_DIR).iterdir()} == keys
        follower.stopping.set()
        leader.stopping.set()


# ---- 7. a node's rotated keys reach the other controllers ----------------------------------------------------------


async def test_a_node_rotated_through_one_controller_is_admitted_by_another_after_its_feed(tmp_path: Path) -> None:
    async with two_sides(tmp_path) as (a, b):
        node_id, old_key, old_curve = await enroll(a.fleet)
        await b.feed.poll()
        new_key, new_curve = security.generate_signing_key(), links.generate_curve_keypair()
        msg = RotateKeys(
            node_id=node_id,
            seq=5,
            ts=time.time(),
            signing_public_key=new_key.public.b64,
            curve_public_key=new_curve.public,
        )
        assert await a.fleet.rotate_keys(node_id, msg, by_previous=False)
        assert b.fleet.authorize_curve(new_curve.public) is None  # not seen yet
        assert await b.feed.poll() == {"fleet"}
        # ZAP admits the new Curve key, and the old one through the overlap; signatures verify with the new.
        assert b.fleet.authorize_curve(new_curve.public) == node_id
        assert b.fleet.authorize_curve(old_curve.public) == node_id
        assert b.fleet.node_key(node_id) == new_key.public
        assert b.fleet.previous_node_key(node_id) == old_key.public
        # The node signs with its new keys on b's channel: b refuses the old ones from then on.
        await b.fleet.keys_in_use(b.fleet.get(node_id))
        assert b.fleet.authorize_curve(old_curve.public) is None
        assert b.fleet.previous_node_key(node_id) is None
        assert b.fleet.authorize_curve(new_curve.public) == node_id


# ---- time is the store's ---------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_controller_with_a_skewed_clock_neither_takes_the_lease_early_nor_fails_live_work(
    pair: tuple[st.Store, st.Store], signer: SigningKey, nursery: trio.Nursery
) -> None:
    a_store, b_store = pair
    cfg = ClusterConfig(lease_s=Seconds(LEASE_S), renew_s=Seconds(0.5))
    a = Leadership.leased(a_store, cfg, controller_id="a", address="http://a.test", clock=time.time)
    await nursery.start(a.run)
    assert a.is_leader
    epoch = a.epoch
    running = await begin(await Workloads.load(a_store, signer, controller="a"), workload_id="wa", key="ka")

    # The fault: b's clock runs 10 lease periods ahead. By it, a's lease and a's row are long expired.
    skew_s = 10 * LEASE_S

    def skewed() -> float:
        return time.time() + skew_s

    b = Leadership.leased(b_store, cfg, controller_id="b", address="http://b.test", clock=skewed)
    await nursery.start(b.run)
    await trio.sleep(2 * LEASE_S)  # several rounds of both
    assert (a.is_leader, a.epoch) == (True, epoch)  # a keeps leading, at its epoch
    assert not b.is_leader
    assert (b.leader_id, b.leader_address) == ("a", "http://a.test")  # b forwards to a
    assert (await b_store.run(st.read_lease)).holder == "a"  # type: ignore[union-attr]
    # a is live to b, and b's sweep (were b to lead) fails nothing of a's.
    assert await other_live_controllers(b_store, "b", LEASE_S) == ["a"]
    b_workloads = await Workloads.load(b_store, signer, controller="b")
    orphans = Orphans(b_store, cfg, controller_id="b", parts=(b_workloads,), clock=skewed)
    assert await orphans.sweep() == 0
    assert await unfinished(a_store) == {running.accepted.workload_id: "a"}
    # a's leader-only writes pass the fence.
    await a.write(st.save_controller, controller_row("probe", 0.0))
