"""One fenced leader among several controllers: the lease, its takeover at epoch + 1, fenced writes,
stepping down, and the keys every controller on a store must share.

Two "controllers" share one SQLite file in a temp dir: the first `Store` comes from `open_store`
(which takes the state-dir lock), the second is a second apsw connection on the same file. Both
run their transactions inline and read a fake wall clock that follows trio's, so every test runs
in virtual time (autojump_clock) with no thread.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import apsw
import attrs
import httpx
import pytest
import trio
import trio.testing

from nexa.config import ClusterConfig, ConfigError, ControlConfig, Seconds, structure_config
from nexa.contracts.domain import AuditDraft, EnrollmentToken, KeyId, Node, NodeId, Role
from nexa.contracts.wire import DesiredAssignments
from nexa.control import store as st
from nexa.control.cluster.leadership import FOLLOWER, LEADER, Leadership
from nexa.control.store.sql import meta
from nexa.control.store.sqlite import LiteDb
from nexa.errors import ControllerKeysDiffer, NotLeader
from nexa.security import hash_token, new_enrollment_token
from tests.conftest import Controller, local_config, start_controller

CFG = ClusterConfig(lease_s=Seconds(5.0), renew_s=Seconds(1.0))
#: The fake wall clock starts here (Unix seconds), so no lease time is near 0.
BASE = 1_700_000_000.0


def clock(skew_s: float = 0.0) -> Callable[[], float]:
    """A wall clock that follows trio's (virtual) clock, `skew_s` ahead of the others."""
    return lambda: BASE + skew_s + trio.current_time()


class FlakyStore:
    """A Store whose lease calls hang once `unreachable` is set (the database no longer answers);
    leader-only writes still go through, so what the fence decides is what the test sees."""

    _LEASE = frozenset({st.renew_lease, st.acquire_lease, st.read_lease, st.save_controller, st.release_lease})

    def __init__(self, store: st.Store) -> None:
        self._store = store
        self.unreachable = False

    @property
    def epoch(self) -> int:
        return self._store.epoch

    async def run(self, fn: Callable[..., object], *args: object) -> object:
        if self.unreachable and fn in self._LEASE:
            await trio.sleep_forever()
        return await self._store.run(fn, *args)


@asynccontextmanager
async def two_stores(tmp_path: Path) -> AsyncIterator[tuple[st.Store, st.Store]]:
    """Two controllers' stores on one database file."""
    async with st.open_store(tmp_path, inline=True) as first:
        db = apsw.Connection(str(tmp_path / st.DB_FILE))
        try:
            yield first, st.Store(LiteDb(db), epoch=0, inline=True)
        finally:
            db.close()


def leased(store: object, name: str, *, skew_s: float = 0.0) -> Leadership:
    return Leadership.leased(
        store,  # type: ignore[arg-type]
        CFG,
        controller_id=name,
        address=f"http://{name}.test:8470",
        clock=clock(skew_s),
    )


@contextmanager
def changes(*leaders: Leadership) -> Iterator[list[tuple[float, str, str, int]]]:
    """(virtual time, controller, role, epoch) at each change of role or epoch."""
    seen: list[tuple[float, str, str, int]] = []
    for lead in leaders:
        lead.on_change(lambda lg: seen.append((trio.current_time(), lg.controller_id, lg.role, lg.epoch)))
    yield seen


async def enrolled_node(store: st.Store, node_id: str = "n1") -> None:
    draft = AuditDraft(
        actor_key_id=KeyId("k"), actor_role=Role.ADMIN, action="t", target="t", prior_sha256=None, next_sha256=None
    )
    secret = new_enrollment_token()
    token = EnrollmentToken(
        id="et_1", token_sha256=hash_token(secret), labels={}, created_at=0, expires_at=BASE * 2, created_by=None
    )
    await store.run(st.insert_token, token, draft)
    node = Node(
        id=NodeId(node_id), hostname="h", signing_public_key="k", curve_public_key="c", labels={}, enrolled_at=0
    )
    await store.run(st.enroll_node, hash_token(secret), 1.0, node, draft)


def stored_desired(store_dir: Path) -> dict[str, str]:
    db = apsw.Connection(str(store_dir / st.DB_FILE), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return {str(k): str(v) for k, v in db.execute("SELECT node_id, body FROM node_desired")}
    finally:
        db.close()


# ---- taking, keeping and handing over the lease ----------------------------------------------------


async def test_the_first_takes_the_lease_and_a_silent_leader_is_replaced_after_lease_s(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with two_stores(tmp_path) as (store_a, store_b), trio.open_nursery() as nursery:
        flaky = FlakyStore(store_a)
        a, b = leased(flaky, "a"), leased(store_b, "b")
        with changes(a, b) as seen:
            await nursery.start(a.run)
            await nursery.start(b.run)
            e = a.epoch
            assert (a.role, a.is_leader, b.role, b.is_leader) == (LEADER, True, FOLLOWER, False)
            assert e == store_a.epoch + 1  # a takeover takes the store's next epoch
            assert (b.epoch, b.leader_address, b.leader_id) == (0, "http://a.test:8470", "a")

            await trio.sleep(3.5)  # renewals keep it
            assert a.is_leader and a.epoch == e and not b.is_leader
            flaky.unreachable = True  # a's renewals hang from its next round on
            silent_from = trio.current_time()
            await trio.sleep(10)
        lost = [t for t, who, role, _ in seen if who == "a" and role == FOLLOWER]
        taken = [(t, epoch) for t, who, role, epoch in seen if who == "b" and role == LEADER]
        assert len(lost) == 1 and len(taken) == 1
        # a stops acting as leader lease_s - renew_s after its last renewal, before b may take the lease.
        assert silent_from < lost[0] <= silent_from + CFG.lease_s - CFG.renew_s
        assert taken[0][0] >= lost[0] + CFG.renew_s
        assert taken[0][0] <= silent_from + CFG.lease_s + CFG.renew_s
        assert taken[0][1] == e + 1 and b.epoch == e + 1 and b.is_leader
        assert not a.is_leader and a.epoch == e  # it signs nothing above the new leader's epoch
        lease = await store_b.run(st.read_lease)
        assert lease is not None and (lease.holder, lease.epoch, lease.address) == ("b", e + 1, "http://b.test:8470")
        nursery.cancel_scope.cancel()


async def test_renewal_keeps_the_lease_and_release_hands_it_over_at_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with two_stores(tmp_path) as (store_a, store_b), trio.open_nursery() as nursery:
        a, b = leased(store_a, "a"), leased(store_b, "b")
        a_scope = trio.CancelScope()

        async def run_a(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with a_scope:
                await a.run(task_status=task_status)

        await nursery.start(run_a)
        await nursery.start(b.run)
        e = a.epoch
        for _ in range(30):  # 30 s: six lease periods
            await trio.sleep(1)
            assert a.is_leader and not b.is_leader and a.epoch == e
            age = a.lease_age_s
            assert age is not None and age <= CFG.renew_s
        took = trio.Event()
        b.on_change(lambda lead: took.set() if lead.is_leader else None)
        stopped = trio.current_time()
        a_scope.cancel()  # a clean shutdown: run releases the lease
        await took.wait()
        assert trio.current_time() - stopped <= CFG.renew_s + 0.01  # b's next round, not lease_s later
        assert b.epoch == e + 1 and not a.is_leader
        rows = {row.id: row for row in await store_b.run(st.list_controllers)}
        assert (rows["a"].role, rows["b"].role, rows["b"].epoch) == (FOLLOWER, LEADER, e + 1)
        nursery.cancel_scope.cancel()


async def test_a_deposed_leaders_write_is_refused_writes_nothing_and_cancels_its_leader_tasks(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with two_stores(tmp_path) as (store_a, store_b), trio.open_nursery() as nursery:
        await enrolled_node(store_a)
        # b's clock runs 6 s ahead: a's lease looks expired to it at once, while a still believes it
        # leads until its next renewal fails. The fence must hold in that window.
        a, b = leased(store_a, "a"), leased(store_b, "b", skew_s=6.0)
        runs: list[str] = []

        async def reconcile() -> None:
            runs.append("started")
            try:
                await trio.sleep_forever()
            finally:
                runs.append("cancelled")

        await nursery.start(a.run)
        await nursery.start(a.while_leader, reconcile)
        await trio.testing.wait_all_tasks_blocked()
        assert runs == ["started"]
        await a.write(st.save_desired, DesiredAssignments(node_id="n1", generation=2), None)
        before = stored_desired(tmp_path)

        await nursery.start(b.run)
        assert b.is_leader and b.epoch == a.epoch + 1
        assert a.is_leader  # it has not noticed yet
        with pytest.raises(NotLeader) as refused:
            await a.write(st.save_desired, DesiredAssignments(node_id="n1", generation=3), None)
        assert refused.value.code == "not_leader" and refused.value.retryable
        assert refused.value.leader_address == "http://b.test:8470"
        assert stored_desired(tmp_path) == before  # nothing of the write
        assert not a.is_leader  # stepped down at once, in the same step
        await trio.testing.wait_all_tasks_blocked()
        assert runs == ["started", "cancelled"]
        with pytest.raises(NotLeader):  # a follower refuses without asking the store
            await a.write(st.save_desired, DesiredAssignments(node_id="n1", generation=3), None)
        await trio.sleep(10)
        assert not a.is_leader and b.is_leader and runs == ["started", "cancelled"]
        nursery.cancel_scope.cancel()


async def test_while_leader_runs_again_at_the_next_leadership(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with two_stores(tmp_path) as (store_a, store_b), trio.open_nursery() as nursery:
        b_scope = trio.CancelScope()
        a, b = leased(store_a, "a"), leased(store_b, "b")
        starts: list[tuple[str, int]] = []

        def task(lead: Leadership) -> Callable[[], object]:
            async def fn() -> None:
                starts.append((lead.controller_id, lead.epoch))
                await trio.sleep_forever()

            return fn

        async def run_b(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with b_scope:
                await b.run(task_status=task_status)

        await nursery.start(run_b)
        await nursery.start(a.run)
        await nursery.start(a.while_leader, task(a))
        await nursery.start(b.while_leader, task(b))
        await trio.sleep(3)
        e = b.epoch
        assert starts == [("b", e)]
        b_scope.cancel()  # b leaves; a takes over and its task starts at the new epoch
        await trio.sleep(3)
        assert starts == [("b", e), ("a", e + 1)]
        nursery.cancel_scope.cancel()


async def test_solo_is_always_the_leader_and_never_touches_the_lease(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with st.open_store(tmp_path, inline=True) as store, trio.open_nursery() as nursery:
        await enrolled_node(store)
        solo = Leadership.solo(store, controller_id="only", address="http://only.test")
        ran = trio.Event()

        async def fn() -> None:
            ran.set()

        await nursery.start(solo.run)
        await nursery.start(solo.while_leader, fn)
        await ran.wait()
        assert (solo.is_leader, solo.role, solo.epoch, solo.lease_age_s) == (True, LEADER, store.epoch, None)
        await solo.write(st.save_desired, DesiredAssignments(node_id="n1", generation=2), None)
        assert "n1" in stored_desired(tmp_path)
        assert await store.run(st.read_lease) is None
        assert await store.run(st.list_controllers) == []
        store.epoch += 1  # a recovery's end moves the store's epoch: the solo leader signs with it
        assert solo.epoch == store.epoch
        view = await solo.view()
        assert (view.leader, view.epoch, [m.id for m in view.controllers]) == ("only", store.epoch, ["only"])
        nursery.cancel_scope.cancel()


# ---- the lease functions themselves -------------------------------------------------------------


async def test_lease_functions_take_renew_refuse_and_release(tmp_path: Path) -> None:
    async with st.open_store(tmp_path, inline=True) as store:
        now = BASE
        first = await store.run(st.acquire_lease, "a", "http://a", now, 5.0)
        assert first is not None and first.holder == "a" and first.epoch == store.epoch + 1
        assert await store.run(st.acquire_lease, "b", "http://b", now + 4.0, 5.0) is None  # held
        again = await store.run(st.acquire_lease, "a", "http://a", now + 4.0, 5.0)  # ours: renewed, same epoch
        assert again is not None and again.epoch == first.epoch and again.expires_at == now + 9.0
        assert await store.run(st.renew_lease, "a", first.epoch, now + 8.0, 5.0)
        assert not await store.run(st.renew_lease, "a", first.epoch + 1, now + 8.0, 5.0)  # wrong epoch
        assert not await store.run(st.renew_lease, "b", first.epoch, now + 8.0, 5.0)  # not the holder
        await store.run(st.check_lease, "a", first.epoch, now + 12.0)
        with pytest.raises(NotLeader):
            await store.run(st.check_lease, "a", first.epoch, now + 13.5)  # expired
        assert not await store.run(st.renew_lease, "a", first.epoch, now + 13.5, 5.0)  # expired: not renewed
        taken = await store.run(st.acquire_lease, "b", "http://b", now + 13.5, 5.0)
        assert taken is not None and (taken.holder, taken.epoch) == ("b", first.epoch + 1)
        with pytest.raises(NotLeader):
            await store.run(st.check_lease, "a", first.epoch, now + 13.5)
        await store.run(st.release_lease, "a", first.epoch)  # not a's any more: nothing changes
        assert await store.run(st.read_lease) == taken
        await store.run(st.release_lease, "b", taken.epoch)
        back = await store.run(st.acquire_lease, "a", "http://a", now + 14.0, 5.0)  # released: taken at once
        assert back is not None and back.epoch == taken.epoch + 1


# ---- the keys every controller on a store shares ----------------------------------------------------


async def test_keys_fingerprint_is_stored_first_then_checked(tmp_path: Path) -> None:
    async with st.open_store(tmp_path, inline=True) as store:
        await store.run(st.check_keys_fingerprint, "f" * 64)  # the first controller stores it
        await store.run(st.check_keys_fingerprint, "f" * 64)  # the same keys pass
        with pytest.raises(ControllerKeysDiffer) as differ:
            await store.run(st.check_keys_fingerprint, "e" * 64)
        assert differ.value.code == "controller_keys_differ"
        assert "every controller on one store must share the same controller keys" in differ.value.message
        await store.run(st.check_keys_fingerprint, "f" * 64)  # still the first one stored
        # This keys directory rotated away from the stored keys: the rotated ones replace them.
        await store.run(st.check_keys_fingerprint, "d" * 64, ("f" * 64,))
        with pytest.raises(ControllerKeysDiffer):
            await store.run(st.check_keys_fingerprint, "f" * 64)


async def test_a_controller_with_other_keys_is_refused_at_start(tmp_path: Path) -> None:
    cfg = local_config(tmp_path)
    async with trio.open_nursery() as nursery:
        first = await start_controller(nursery, cfg)
        first.stopping.set()
    keys = Path(cfg.state_dir) / "keys"
    shutil.move(keys, tmp_path / "first-keys")  # a second controller with its own keys on this store
    async with trio.open_nursery() as nursery:
        with pytest.raises(ControllerKeysDiffer, match="copy the keys directory") as differ:
            await start_controller(nursery, cfg, admin_key=first.admin_key)
    assert differ.value.keys_dir == str(keys)
    shutil.rmtree(keys)
    shutil.move(tmp_path / "first-keys", keys)  # the shared keys: it starts
    os.chmod(keys, 0o700)
    async with trio.open_nursery() as nursery:
        again = await start_controller(nursery, cfg, admin_key=first.admin_key)
        again.stopping.set()


async def test_a_controller_restarts_with_the_keys_it_rotated_to(tmp_path: Path) -> None:
    cfg = local_config(tmp_path)
    async with trio.open_nursery() as nursery:
        first = await start_controller(nursery, cfg)
        async with first.client() as http:
            rotated = await http.post("/api/v1/controller/rotate-keys")
        assert rotated.status_code == 200, rotated.text
        first.stopping.set()
    async with trio.open_nursery() as nursery:  # the stored fingerprint was the keys rotated away from
        again = await start_controller(nursery, cfg, admin_key=first.admin_key)
        again.stopping.set()
    async with st.open_store(cfg.state_dir) as store:
        fingerprint = await store.run(meta, "keys_fingerprint")
    assert fingerprint == rotated.json()["controller_fingerprint"]


# ---- what the API shows ---------------------------------------------------------------------------


async def test_readyz_and_cluster_show_the_leader_and_its_epoch(controller: Controller) -> None:
    async with httpx.AsyncClient(base_url=controller.url) as http:
        ready = (await http.get("/readyz")).json()
        assert (await http.get("/api/v1/cluster")).status_code == 401
    assert ready == {"status": "ready", "role": "leader", "epoch": 1, "lease_age_s": None}
    async with controller.client() as http:
        resp = await http.get("/api/v1/cluster")
    assert resp.status_code == 200
    view = resp.json()
    [me] = view["controllers"]
    assert view["leader"] == me["id"] == view["answered_by"] and view["epoch"] == 1
    assert (me["role"], me["epoch"], me["leader"], me["lease_age_s"]) == ("leader", 1, True, None)
    assert me["id"].endswith(":0") and me["address"] == "http://127.0.0.1:0"


def test_renew_s_must_be_below_half_of_lease_s() -> None:
    with pytest.raises(ConfigError) as bad:
        structure_config({"cluster": {"lease_s": 4, "renew_s": 2}}, ControlConfig)
    assert "renew_s (2) must be below half of lease_s (4)" in bad.value.message
    ok = structure_config({"cluster": {"lease_s": 4, "renew_s": 1.5, "controller_id": "c1"}}, ControlConfig)
    assert (ok.cluster.lease_s, ok.cluster.renew_s, ok.cluster.controller_id) == (4.0, 1.5, "c1")
    with pytest.raises(ValueError, match="must be below half"):
        attrs.evolve(ok.cluster, renew_s=Seconds(2.0))
