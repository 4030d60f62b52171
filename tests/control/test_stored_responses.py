"""Stored Responses API responses' pins: the rules and each process's cache
(`control/datapath/stored.py`, pure), the store's rows (`control/store/responses.py`, on both
backends: `store_cfg`) and what a controller does with them (`control/datapath/pins.py`): per
tenant, a day each, capped per tenant, found by another controller of the same store."""

from __future__ import annotations

import time
from pathlib import Path

import attrs
import pytest

from nexa.config import StoreConfig
from nexa.contracts.deployments import ServingReplica, ServingSet
from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.gateway import Api, Capability
from nexa.contracts.models import ModelRef
from nexa.control import store as st
from nexa.control.datapath.calls import Work
from nexa.control.datapath.gateway import _pinned
from nexa.control.datapath.pins import Pins
from nexa.control.datapath.stored import MAX_RESPONSE_ID_CHARS, STORED_RESPONSE_TTL_S, StoredResponses
from nexa.errors import StoredResponseLost, StoreUnavailable
from tests.support.postgres import pg_url_fixture, postgres_fixture, store_cfg_fixture  # noqa: F401 - fixtures

ACME, GLOBEX = TenantId("acme"), TenantId("globex")


def pin(replica: str, at: float = 0.0) -> st.Pin:
    return st.Pin(model="chat", deployment="chat-a", replica_id=replica, made_at=at)


# --- the cache (pure) ----------------------------------------------------------------------------


def test_a_response_is_found_for_its_tenant_only() -> None:
    stored = StoredResponses()
    stored.remember(ACME, "resp_1", pin("r1"))
    assert stored.find(ACME, "resp_1", 1.0) == pin("r1")
    assert stored.find(GLOBEX, "resp_1", 1.0) is None  # another tenant's id: never routed
    assert stored.find(ACME, "resp_2", 1.0) is None
    stored.forget(ACME, "resp_1")
    assert stored.find(ACME, "resp_1", 1.0) is None


def test_a_cached_pin_is_forgotten_after_its_ttl() -> None:
    stored = StoredResponses(ttl_s=10.0)
    stored.remember(ACME, "old", pin("r1", at=0.0))
    stored.remember(ACME, "new", pin("r2", at=5.0))
    assert stored.find(ACME, "old", 9.9) is not None
    assert stored.find(ACME, "old", 10.0) is None and stored.find(ACME, "new", 10.0) == pin("r2", at=5.0)
    assert stored.find(ACME, "new", 15.0) is None and len(stored) == 0


def test_the_cache_is_bounded_dropping_the_least_recently_used() -> None:
    stored = StoredResponses(max_entries=2)
    for n in range(2):
        stored.remember(ACME, f"resp_{n}", pin(f"r{n}", at=float(n)))
    assert stored.find(ACME, "resp_0", 2.0) is not None  # used: resp_1 is now the least recent
    stored.remember(ACME, "resp_2", pin("r2", at=2.0))
    assert len(stored) == 2
    assert stored.find(ACME, "resp_1", 3.0) is None
    assert stored.find(ACME, "resp_0", 3.0) == pin("r0", at=0.0)
    # Ids no runtime makes are not kept: too long, empty, or not a plain path segment.
    for bad in ("x" * (MAX_RESPONSE_ID_CHARS + 1), "", "../admin", "resp 1", "resp/1"):
        stored.remember(ACME, bad, pin("r9", at=3.0))
    assert len(stored) == 2


def test_a_pinned_request_goes_to_its_replica_alone_or_is_lost() -> None:
    ref = ModelRef(model="tiny", version="v1")
    replicas = [
        ServingReplica(replica_id=r, node_id=n, deployment="chat", model=ref, keeps_responses=True)
        for r, n in (("r1", "sim-1"), ("r2", "sim-2"))
    ]
    serving = ServingSet(model=ref, replicas=replicas, deployments=["chat"])
    work = Work(
        request_id="req-1",
        api=Api.RESPONSES,
        tenant=ACME,
        key_id=KeyId("k1"),
        capability=Capability.RESPONSES,
        model="chat",
        body={"input": "and then", "previous_response_id": "resp_1"},
        stream=False,
        deadline_at=time.time() + 30,
    )
    assert _pinned(work, serving) is serving  # not pinned: every replica
    assert [r.replica_id for r in _pinned(attrs.evolve(work, pin="r2"), serving).replicas] == ["r2"]
    with pytest.raises(StoredResponseLost) as lost:
        _pinned(attrs.evolve(work, pin="r3"), serving)  # its replica is gone: never another one
    assert lost.value.code == "stored_response_lost" and "send the whole conversation" in lost.value.message


# --- the store's rows (both backends) ------------------------------------------------------------


async def test_the_store_finds_a_pin_for_its_tenant_until_it_expires(tmp_path: Path, store_cfg: StoreConfig) -> None:
    async with st.open_store(tmp_path, store_cfg) as store:
        await store.run(st.save_stored_response, ACME, "resp_1", pin("r1", at=100.0))
        assert await store.read(st.get_stored_response, ACME, "resp_1", 50.0) == pin("r1", at=100.0)
        assert await store.read(st.get_stored_response, GLOBEX, "resp_1", 50.0) is None
        assert await store.read(st.get_stored_response, ACME, "resp_2", 50.0) is None
        # Made before the oldest still found: not found, whether the sweep deleted it yet or not.
        assert await store.read(st.get_stored_response, ACME, "resp_1", 100.5) is None
        # Saved again (the same id from the same tenant): replaced, not a second row.
        await store.run(st.save_stored_response, ACME, "resp_1", pin("r2", at=200.0))
        assert await store.read(st.get_stored_response, ACME, "resp_1", 150.0) == pin("r2", at=200.0)
        assert await store.run(st.delete_stored_response, ACME, "resp_1") is True
        assert await store.run(st.delete_stored_response, ACME, "resp_1") is False
        assert await store.read(st.get_stored_response, ACME, "resp_1", 0.0) is None


async def test_the_sweep_deletes_expired_pins_and_each_tenants_oldest_past_the_cap(
    tmp_path: Path, store_cfg: StoreConfig
) -> None:
    async with st.open_store(tmp_path, store_cfg) as store:
        for n in range(5):
            await store.run(st.save_stored_response, ACME, f"a{n}", pin("r1", at=float(100 + n)))
        for n in range(2):
            await store.run(st.save_stored_response, GLOBEX, f"g{n}", pin("r2", at=float(100 + n)))
        assert await store.prune(st.prune_stored_responses, 101.0) == 2  # a0 and g0 made before 101
        assert await store.run(st.cap_stored_responses, 3) == 1  # acme has 4 left: its oldest goes
        left = {
            (tenant, ident)
            for tenant, ident in [(ACME, f"a{n}") for n in range(5)] + [(GLOBEX, f"g{n}") for n in range(2)]
            if await store.read(st.get_stored_response, tenant, ident, 0.0) is not None
        }
        assert left == {(ACME, "a2"), (ACME, "a3"), (ACME, "a4"), (GLOBEX, "g1")}
        assert await store.run(st.cap_stored_responses, 3) == 0  # nothing past it now


# --- a controller's pins: the store behind its cache ----------------------------------------------


async def test_a_pin_recorded_by_one_controller_is_found_by_another_and_after_a_restart(tmp_path: Path) -> None:
    now = time.time()
    async with st.open_store(tmp_path) as store:
        made = Pins(store)
        await made.remember(ACME, "resp_1", pin("r1", at=now))
        await made.remember(ACME, "../evil", pin("r1", at=now))  # no runtime's id: not recorded
        other = Pins(store)  # another gateway worker on the same store: its cache is empty
        assert await other.find(ACME, "resp_1") == pin("r1", at=now)
        assert len(other.cache) == 1  # read once from the store, then from its cache
        assert await other.find(GLOBEX, "resp_1") is None and await other.find(ACME, "../evil") is None
    async with st.open_store(tmp_path) as store:  # the controller restarted
        assert await Pins(store).find(ACME, "resp_1") == pin("r1", at=now)


async def test_a_controller_finds_no_expired_pin_and_its_sweep_keeps_a_tenant_under_the_cap(tmp_path: Path) -> None:
    now = time.time()
    async with st.open_store(tmp_path) as store:
        old = now - STORED_RESPONSE_TTL_S - 1
        await store.run(st.save_stored_response, ACME, "resp_old", pin("r1", at=old))
        pins = Pins(store, cap=2)
        assert await pins.find(ACME, "resp_old") is None  # expired: not found before any sweep
        for n in range(3):
            await pins.remember(ACME, f"resp_{n}", pin("r1", at=now + n))
        assert await pins.sweep() == 2  # the expired one, and the oldest past the cap of 2
        fresh = Pins(store)
        assert [await fresh.find(ACME, f"resp_{n}") is not None for n in range(3)] == [False, True, True]


class _FailingStore:
    """A store whose every transaction fails (`StoreUnavailable`), as a lost database does."""

    async def run(self, fn: object, *args: object) -> object:
        raise StoreUnavailable("the database is unreachable")

    read = run

    async def prune(self, fn: object, before: float) -> int:
        raise StoreUnavailable("the database is unreachable")


async def test_a_pin_whose_write_failed_is_found_by_its_own_process_and_a_read_failure_is_typed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pins = Pins(_FailingStore())  # type: ignore[arg-type]
    await pins.remember(ACME, "resp_1", pin("r1", at=time.time()))  # the answer goes on: logged, cached
    assert "recording a stored response failed (store_unavailable)" in caplog.text
    assert await pins.find(ACME, "resp_1") is not None
    with pytest.raises(StoreUnavailable):  # not in the cache: the store must answer, and cannot
        await pins.find(ACME, "resp_2")
    assert await pins.sweep() == 0 and "sweeping stored responses failed" in caplog.text
