"""The durable store: SQLite settings, migrations, epochs, the state-dir lock and the audit chain.

Most tests run on both backends (`store_cfg`: SQLite in the state dir, then a fresh database on
the run's PostgreSQL); the SQLite file's own settings, lock and plans stay SQLite's.
PostgreSQL-only behaviour is in `test_store_postgres.py`."""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import apsw
import attrs
import pytest
import trio

from nexa.config import StoreConfig
from nexa.contracts.domain import AuditDraft, KeyId, Role, Tenant, TenantId
from nexa.contracts.gateway import AcceptedWorkload, Capability, Priority, WorkloadState
from nexa.contracts.groups import GroupMember, GroupRunRecord
from nexa.contracts.models import ModelRef
from nexa.control import store as st
from nexa.control.store.sql import txn
from nexa.errors import Conflict, StateDirLocked, StoreBusy, StoreConflict, StoreError, StoreUnavailable
from tests.support.deployments import placed_deployment
from tests.support.postgres import pg_url_fixture, postgres_fixture, store_cfg_fixture  # noqa: F401


def draft(action: str, target: str = "t") -> AuditDraft:
    return AuditDraft(
        actor_key_id=KeyId("abc"),
        actor_role=Role.ADMIN,
        action=action,
        target=target,
        prior_sha256=None,
        next_sha256=None,
    )


async def fill(state_dir: Path, n: int, cfg: StoreConfig | None = None) -> list[int]:
    async with st.open_store(state_dir, cfg) as store:
        events = [await store.run(st.record_audit, draft(f"a.{i}", f"t/{i}")) for i in range(n)]
    return [e.seq for e in events]


def tamper(state_dir: Path, sql: str, *args: object, cfg: StoreConfig | None = None) -> None:
    """Edit the database the way someone with the sqlite3 shell (or psql) would."""
    if cfg is not None and cfg.url:
        import psycopg

        from nexa.control.store.pg import to_pyformat

        with psycopg.connect(cfg.url, autocommit=True) as conn:
            conn.execute(to_pyformat(sql).encode(), args)
        return
    db = sqlite3.connect(state_dir / st.DB_FILE)
    db.execute(sql, args)
    db.commit()
    db.close()


async def verify(state_dir: Path, cfg: StoreConfig | None = None) -> object:
    async with st.open_store(state_dir, cfg) as store:
        return await store.run(st.verify_audit)


async def test_database_settings_and_schema(tmp_path: Path) -> None:
    async with st.open_store(tmp_path) as store:

        def settings(db: apsw.Connection) -> tuple[object, ...]:
            return tuple(
                db.execute(f"PRAGMA {name}").fetchall()[0][0]
                for name in ("journal_mode", "synchronous", "application_id", "user_version", "foreign_keys")
            )

        journal, sync, app_id, version, fks = await store.run(settings)
    assert journal == "wal"
    assert sync == 2  # FULL
    assert app_id == st.APPLICATION_ID
    assert version == len(st.MIGRATIONS)
    assert fks == 1
    assert (tmp_path / st.LOCK_FILE).stat().st_mode & 0o077 == 0


async def test_each_open_takes_a_strictly_higher_epoch_on_sqlite_and_none_on_a_shared_store(
    tmp_path: Path, store_cfg: StoreConfig
) -> None:
    epochs = []
    for _ in range(4):
        async with st.open_store(tmp_path, store_cfg) as store:
            epochs.append(store.epoch)
            assert store.backend == ("postgresql" if store_cfg.url else "sqlite")
    # SQLite: one controller, each start fences the last. PostgreSQL: several controllers start and
    # stop freely; only a takeover of the lease takes an epoch (`acquire_lease`).
    assert epochs == ([0, 0, 0, 0] if store_cfg.url else [1, 2, 3, 4])


async def test_a_second_open_on_the_same_state_dir_is_refused(tmp_path: Path) -> None:
    async with st.open_store(tmp_path):
        with pytest.raises(StateDirLocked, match=str(tmp_path)):
            async with st.open_store(tmp_path):
                pass
    async with st.open_store(tmp_path) as again:  # released on close
        assert again.epoch == 2


async def test_a_foreign_database_is_refused(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / st.DB_FILE)
    db.execute("CREATE TABLE x (y)")
    db.execute("PRAGMA application_id = 42")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="does not belong to nexa"):
        async with st.open_store(tmp_path):
            pass


async def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    await fill(tmp_path, 1)
    tamper(tmp_path, f"PRAGMA user_version = {len(st.MIGRATIONS) + 1}")
    with pytest.raises(StoreError, match="newer nexa"):
        async with st.open_store(tmp_path):
            pass


async def test_intact_chain_verifies(tmp_path: Path, store_cfg: StoreConfig) -> None:
    assert await fill(tmp_path, 5, store_cfg) == [1, 2, 3, 4, 5]
    verdict = await verify(tmp_path, store_cfg)
    assert verdict.ok and verdict.checked == 5


@pytest.mark.parametrize(
    ("sql", "bad_seq", "verified_before"),
    [
        ("UPDATE audit SET target = 'someone-else' WHERE seq = 3", 3, 2),
        ("UPDATE audit SET result = 'denied' WHERE seq = 1", 1, 0),
        ("UPDATE audit SET time = time + 1 WHERE seq = 4", 4, 3),
        ("DELETE FROM audit WHERE seq = 2", 3, 1),
        # Reorder: swap the content of events 2 and 3 (seq is the order).
        ("UPDATE audit SET seq = CASE seq WHEN 2 THEN -3 WHEN 3 THEN -2 END WHERE seq IN (2, 3)", 2, 1),
        ("DELETE FROM audit WHERE seq = 5", 5, 4),
    ],
    ids=["edit-target", "edit-result", "edit-time", "delete-middle", "reorder", "delete-tail"],
)
async def test_tampering_is_found_and_named(
    tmp_path: Path, store_cfg: StoreConfig, sql: str, bad_seq: int, verified_before: int
) -> None:
    await fill(tmp_path, 5, store_cfg)
    if "CASE" in sql:
        tamper(tmp_path, sql, cfg=store_cfg)
        tamper(tmp_path, "UPDATE audit SET seq = -seq WHERE seq < 0", cfg=store_cfg)
    else:
        tamper(tmp_path, sql, cfg=store_cfg)
    verdict = await verify(tmp_path, store_cfg)
    assert not verdict.ok
    assert verdict.first_bad_seq == bad_seq
    assert verdict.checked == verified_before
    assert verdict.reason


async def test_recomputed_hash_is_detected_by_the_next_link(tmp_path: Path, store_cfg: StoreConfig) -> None:
    # Someone edits event 2 and recomputes its own sha256: event 3 no longer links to it.
    await fill(tmp_path, 4, store_cfg)
    async with st.open_store(tmp_path, store_cfg) as store:
        events = await store.run(st.list_audit, st.AuditQuery())
    import attrs

    forged = attrs.evolve(events[1], target="forged")
    tamper(
        tmp_path,
        "UPDATE audit SET target = ?, sha256 = ? WHERE seq = 2",
        forged.target,
        st.event_sha256(forged),
        cfg=store_cfg,
    )
    verdict = await verify(tmp_path, store_cfg)
    assert not verdict.ok and verdict.first_bad_seq == 3


async def test_transactions_run_one_at_a_time(tmp_path: Path, store_cfg: StoreConfig) -> None:
    async with st.open_store(tmp_path, store_cfg) as store, trio.open_nursery() as nursery:
        for i in range(50):
            nursery.start_soon(store.run, st.record_audit, draft(f"c.{i}"))
    assert (await verify(tmp_path, store_cfg)).checked == 50


async def test_an_older_desired_set_never_overwrites_a_newer_one(tmp_path: Path, store_cfg: StoreConfig) -> None:
    from nexa.contracts.domain import Node, NodeId
    from nexa.contracts.wire import DesiredAssignments
    from nexa.security import hash_token, new_enrollment_token

    secret = new_enrollment_token()
    async with st.open_store(tmp_path, store_cfg) as store:
        from nexa.contracts.domain import EnrollmentToken

        token = EnrollmentToken(
            id="et_1", token_sha256=hash_token(secret), labels={}, created_at=0, expires_at=2e9, created_by=None
        )
        await store.run(st.insert_token, token, draft("t"))
        node = Node(
            id=NodeId("n1"), hostname="h", signing_public_key="k", curve_public_key="c", labels={}, enrolled_at=0
        )
        await store.run(st.enroll_node, hash_token(secret), 1.0, node, draft("enroll"))
        await store.run(st.save_desired, DesiredAssignments(node_id="n1", generation=3), None)
        await store.run(st.save_desired, DesiredAssignments(node_id="n1", generation=2, acked_generation=2), None)
        [(_, _, desired)] = await store.run(st.load_nodes)
        assert desired is not None and desired.generation == 3
        await store.run(st.save_desired, DesiredAssignments(node_id="n1", generation=4), None)
        [(_, _, newer)] = await store.run(st.load_nodes)
    assert newer is not None and newer.generation == 4


# ---- gateway tables (migration 5) ----------------------------------------------------------------


async def test_usage_is_indexed_for_time_and_tenant_queries(tmp_path: Path) -> None:
    async with st.open_store(tmp_path) as store:

        def plans(db: apsw.Connection) -> tuple[str, str]:
            by_time = db.execute(
                "EXPLAIN QUERY PLAN SELECT count(*) FROM usage WHERE finished_at >= ?", (0.0,)
            ).fetchall()
            by_tenant = db.execute(
                "EXPLAIN QUERY PLAN SELECT count(*) FROM usage WHERE tenant = ? AND finished_at >= ?", ("t", 0.0)
            ).fetchall()
            return repr(by_time), repr(by_tenant)

        by_time, by_tenant = await store.run(plans)
    assert "usage_finished" in by_time
    assert "usage_tenant" in by_tenant


def queued(tenant: TenantId, workload_id: str, key_sha256: str, accepted_at: float) -> st.WorkloadRow:
    accepted = AcceptedWorkload(
        tenant=tenant,
        workload_id=workload_id,
        idempotency_key_sha256=key_sha256,
        key_id=KeyId("k"),
        capability=Capability.EMBEDDING,
        alias="emb",
        model="emb",
        priority=Priority.BATCH,
        accepted_at=accepted_at,
    )
    return st.WorkloadRow(accepted=accepted, state=WorkloadState.QUEUED)


async def test_workload_ids_and_keys_are_unique_per_tenant_only(tmp_path: Path, store_cfg: StoreConfig) -> None:
    def row(tenant: str, workload_id: str, key: str) -> st.WorkloadRow:
        return queued(TenantId(tenant), workload_id, key, 1.0)

    async with st.open_store(tmp_path, store_cfg) as store:
        await store.run(st.insert_workload, row("a", "w1", "k1"))
        await store.run(st.insert_workload, row("b", "w1", "k1"))  # another tenant: no clash
        with pytest.raises(Conflict, match="another idempotency key"):
            await store.run(st.insert_workload, row("a", "w1", "k2"))
        with pytest.raises(Conflict, match="used before for workload w1"):
            await store.run(st.insert_workload, row("a", "w2", "k1"))
        [unfinished_a, unfinished_b] = await store.run(st.unfinished_workloads)
        assert {unfinished_a.accepted.tenant, unfinished_b.accepted.tenant} == {"a", "b"}
        assert await store.run(st.get_workload, TenantId("a"), "w1") == row("a", "w1", "k1")
        assert await store.run(st.get_workload, TenantId("c"), "w1") is None


async def test_a_tenants_workloads_page_by_acceptance_and_stay_stable_under_inserts(
    tmp_path: Path, store_cfg: StoreConfig
) -> None:
    def row(tenant: str, workload_id: str, accepted_at: float) -> st.WorkloadRow:
        return queued(TenantId(tenant), workload_id, f"{tenant}-{workload_id}", accepted_at)

    a = TenantId("a")
    async with st.open_store(tmp_path, store_cfg) as store:
        # Two accepted in the same instant: the id orders them.
        for wid, at in (("w3", 3.0), ("w1", 1.0), ("w2b", 2.0), ("w2a", 2.0), ("w4", 4.0)):
            await store.run(st.insert_workload, row("a", wid, at))
        await store.run(st.insert_workload, row("b", "wb", 1.5))  # another tenant's: never listed
        seen: list[str] = []
        after: st.WorkloadKey | None = None
        while True:
            page = await store.run(st.list_workloads, a, after, 2)
            seen += [w.accepted.workload_id for w in page]
            if len(page) < 2:
                break
            after = (page[-1].accepted.accepted_at, page[-1].accepted.workload_id)
            # Accepted meanwhile: one before the cursor (not repeated, not listed) and one after it.
            await store.run(st.insert_workload, row("a", f"early{len(seen)}", 0.5))
            await store.run(st.insert_workload, row("a", f"late{len(seen)}", 10.0 + len(seen)))
        assert seen == ["w1", "w2a", "w2b", "w3", "w4", "late2", "late4", "late6", "late8"]
        assert await store.run(st.list_workloads, TenantId("c"), None, 10) == []
        if store.backend != "sqlite":
            return  # the plan below is SQLite's (PostgreSQL's indexes: test_store_postgres.py)

        def plan(db: apsw.Connection) -> str:
            sql = "EXPLAIN QUERY PLAN SELECT workload_id FROM workload WHERE tenant = ? AND (accepted_at, workload_id) > (?, ?) ORDER BY accepted_at, workload_id LIMIT 2"  # noqa: E501
            return repr(db.execute(sql, ("a", 1.0, "w1")).fetchall())

        assert "workload_tenant_accepted" in await store.run(plan)


def test_importing_the_store_applies_nothing_and_opening_applies_best_practice_once(tmp_path: Path) -> None:
    script = f"""
import sys
import apsw, trio
from nexa.control import store as st
assert apsw.connection_hooks == [], "applied at import"
async def main():
    for _ in range(2):
        async with st.open_store({str(tmp_path)!r}) as store:
            assert await store.run(lambda db: db.execute("PRAGMA journal_mode").fetchall()[0][0]) == "wal"
trio.run(main)
assert len(apsw.connection_hooks) == 1, apsw.connection_hooks
assert "psycopg" not in sys.modules, "the SQLite store loaded psycopg"
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)


async def test_measured_memory_survives_a_reopen_and_only_the_latest_figure_is_kept(
    tmp_path: Path, store_cfg: StoreConfig
) -> None:
    async with st.open_store(tmp_path, store_cfg) as store:
        assert await store.run(st.load_measured_memory) == {}
        await store.run(st.save_measured_memory, "a" * 64, 3 * 1024**3)
        await store.run(st.save_measured_memory, "a" * 64, 5 * 1024**3)
        await store.run(st.save_measured_memory, "b" * 64, 1024)
    async with st.open_store(tmp_path, store_cfg) as store:
        assert await store.run(st.load_measured_memory) == {"a" * 64: 5 * 1024**3, "b" * 64: 1024}


async def test_group_runs_are_written_with_their_deployment_survive_a_reopen_and_go_with_it(
    tmp_path: Path, store_cfg: StoreConfig
) -> None:
    dep = placed_deployment("n1", ModelRef(model="tiny", version="v1"))
    members = [GroupMember(rank=i, node_id=f"n{i + 1}", address=f"10.0.0.{i + 1}", port=19100) for i in range(2)]
    ready = GroupRunRecord(replica_id="chat-a-1", deployment=dep.name, phase="ready", members=members, restarts=2)
    async with st.open_store(tmp_path, store_cfg) as store:
        assert await store.run(st.load_group_runs) == []
        await store.run(st.save_deployment, dep.name, dep, None, [], draft("deployment.create"), [ready])
        # A commit that passes no runs keeps those stored; one alone replaces the deployment's.
        await store.run(st.save_deployment, dep.name, dep, None, [], draft("deployment.scale"))
        assert await store.run(st.load_group_runs) == [ready]
        restarting = attrs.evolve(ready, phase="restarting", failures=1, restarts=3, restart_at=1234.5)
        await store.run(st.save_group_runs, dep.name, [restarting], draft("deployment.group"))
    async with st.open_store(tmp_path, store_cfg) as store:
        assert await store.run(st.load_group_runs) == [restarting]
        await store.run(st.save_deployment, dep.name, None, None, [], draft("deployment.delete"))
        assert await store.run(st.load_group_runs) == []


# ---- the backend seam: a transaction function and the store's callers see nexa's errors, never apsw's or psycopg's


async def test_a_violated_constraint_is_store_conflict_inside_the_function_and_at_the_lane(
    tmp_path: Path, store_cfg: StoreConfig
) -> None:
    tenant = Tenant(id=TenantId("acme"), display_name="Acme", created_at=1.0)

    def insert_again(db: st.Db) -> StoreConflict | None:
        try:
            with txn(db):
                db.execute("INSERT INTO tenant(id, display_name, created_at) VALUES (?, ?, ?)", ("acme", "Other", 2.0))
        except StoreConflict as exc:  # what a transaction function catches (`rotate_node_keys`)
            return exc
        return None

    async with st.open_store(tmp_path, store_cfg) as store:
        await store.run(st.insert_tenant, tenant, draft("tenant"))
        caught = await store.run(insert_again)
        assert isinstance(caught, Conflict) and not caught.retryable
        assert caught.constraint == ("tenant_pkey" if store_cfg.url else "tenant.id")
        assert caught.message == f"conflicts with existing state ({caught.constraint})"
        with pytest.raises(StoreConflict):  # and what the store's callers get from the lane
            await store.run(st.insert_tenant, tenant, draft("tenant again"))
        assert await store.run(st.load_tenants) == [tenant]
        assert (await store.run(st.audit_head))[0] == 1  # nothing of either refused write stayed


@contextlib.contextmanager
def another_writer(state_dir: Path, cfg: StoreConfig) -> Iterator[None]:
    """Another connection's open transaction that has written the audit head. On SQLite through
    apsw, as the store: a second SQLite library in this process (sqlite3's) would not see its locks."""
    hold = "UPDATE meta SET value = value WHERE key = 'audit_head_seq'"
    if cfg.url:
        import psycopg

        with psycopg.connect(cfg.url) as conn:  # not autocommit: the UPDATE opens a transaction
            conn.execute(hold.encode())
            yield
            conn.rollback()
        return
    db = apsw.Connection(str(state_dir / st.DB_FILE))
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute(hold)
        yield
        db.execute("ROLLBACK")
    finally:
        db.close()


async def test_a_lock_another_writer_holds_past_the_wait_is_store_busy_and_writes_nothing(
    tmp_path: Path, store_cfg: StoreConfig
) -> None:
    async with st.open_store(tmp_path, store_cfg) as store:
        await store.run(st.record_audit, draft("first"))
        if store_cfg.url:  # PostgreSQL waits `lock_timeout` (10 s): shorter here, for this session
            await store.run(lambda db: db.execute("SET lock_timeout = '200ms'"))
        with another_writer(tmp_path, store_cfg):
            with pytest.raises(StoreBusy) as caught:  # SQLite: past apsw's busy timeout (100 ms)
                await store.run(st.record_audit, draft("blocked"))
            assert caught.value.retryable and isinstance(caught.value, StoreUnavailable)
        assert (await store.run(st.record_audit, draft("after"))).seq == 2  # the blocked one wrote nothing
    assert (await verify(tmp_path, store_cfg)).checked == 2
