"""Admission in virtual time: priority order by class weight, tenant fairness within a priority, bounded queues,
deadlines and cancellation without slot leaks, capacity changes."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from nexa.config import GatewayConfig
from nexa.contracts.domain import TenantId
from nexa.contracts.gateway import Priority
from nexa.control.datapath.admission import Admission, ModelAdmission
from nexa.errors import DeadlineExceeded, QueueFull
from nexa.telemetry import Metrics

M = "llama:1"
A, B, C = TenantId("a"), TenantId("b"), TenantId("c")
FAR = 1e9


def admission(**cfg: int) -> Admission:
    return Admission(GatewayConfig(**cfg), Metrics())  # type: ignore[arg-type]


class Order:
    """Runs requests that each hold their slot until released, and records the grant order."""

    def __init__(self, adm: Admission, nursery: trio.Nursery) -> None:
        self.adm = adm
        self.nursery = nursery
        self.granted: list[str] = []
        self.release = trio.Event()

    async def request(self, name: str, tenant: TenantId, priority: Priority) -> None:
        async with self.adm.slot(M, tenant, priority, FAR):
            self.granted.append(name)
            await self.release.wait()

    async def start(self, name: str, tenant: TenantId, priority: Priority = Priority.STANDARD) -> None:
        self.nursery.start_soon(self.request, name, tenant, priority)
        await trio.testing.wait_all_tasks_blocked()


async def test_a_free_slot_is_taken_at_once(autojump_clock: trio.testing.MockClock) -> None:
    adm = admission()
    adm.set_capacity(M, 2)
    async with adm.slot(M, A, Priority.BATCH, trio.current_time() + 1) as queued:
        assert queued == 0
        assert adm.statistics().models[M].in_use == 1
    assert adm.statistics().models[M].in_use == 0


async def test_waiters_are_granted_by_priority(nursery: trio.Nursery) -> None:
    adm = admission()
    adm.set_capacity(M, 1)
    granted: list[str] = []
    done: dict[str, trio.Event] = {}

    async def hold(name: str, priority: Priority) -> None:
        done[name] = trio.Event()
        async with adm.slot(M, A, priority, FAR):
            granted.append(name)
            await done[name].wait()

    for name, priority in (
        ("first", Priority.STANDARD),
        ("b1", Priority.BATCH),
        ("s1", Priority.STANDARD),
        ("i1", Priority.INTERACTIVE),
    ):
        nursery.start_soon(hold, name, priority)
        await trio.testing.wait_all_tasks_blocked()
    assert adm.depths()[M] == {Priority.INTERACTIVE: 1, Priority.STANDARD: 1, Priority.BATCH: 1}
    for _ in range(4):
        done[granted[-1]].set()  # the one holding the slot finishes
        await trio.testing.wait_all_tasks_blocked()
    assert granted == ["first", "i1", "s1", "b1"]


async def test_one_tenants_burst_does_not_starve_another_of_the_same_class(nursery: trio.Nursery) -> None:
    adm = admission()
    adm.set_capacity(M, 1)
    granted: list[TenantId] = []
    step = trio.Semaphore(0)

    async def request(tenant: TenantId) -> None:
        async with adm.slot(M, tenant, Priority.STANDARD, FAR):
            granted.append(tenant)
            await step.acquire()

    for _ in range(51):
        nursery.start_soon(request, A)
    await trio.testing.wait_all_tasks_blocked()
    nursery.start_soon(request, B)
    await trio.testing.wait_all_tasks_blocked()
    assert adm.depths()[M][Priority.STANDARD] == 51
    for _ in range(3):
        step.release()
        await trio.testing.wait_all_tasks_blocked()
    # A's first held the slot; B's single request is among the next two grants, not after 50 of A's.
    assert B in granted[1:3]
    for _ in range(48):
        step.release()
        await trio.testing.wait_all_tasks_blocked()
    assert granted.count(A) == 51 and granted.count(B) == 1


async def test_a_flood_of_a_higher_class_does_not_starve_a_lower_one(nursery: trio.Nursery) -> None:
    adm = admission()
    adm.set_capacity(M, 1)
    granted: list[Priority] = []
    step = trio.Semaphore(0)

    async def request(tenant: TenantId, priority: Priority) -> None:
        async with adm.slot(M, tenant, priority, FAR):
            granted.append(priority)
            await step.acquire()

    for _ in range(40):
        nursery.start_soon(request, A, Priority.INTERACTIVE)
    await trio.testing.wait_all_tasks_blocked()
    for tenant, priority in ((B, Priority.STANDARD), (B, Priority.STANDARD), (C, Priority.BATCH)):
        nursery.start_soon(request, tenant, priority)
    await trio.testing.wait_all_tasks_blocked()
    for _ in range(7):
        step.release()
        await trio.testing.wait_all_tasks_blocked()
    # After A's first (which took the free slot): of every 7 grants while all three classes wait,
    # 4 interactive, 2 standard, 1 batch; interactive first.
    assert granted[1] is Priority.INTERACTIVE
    assert sorted(granted[1:8], key=lambda p: p.rank) == [Priority.INTERACTIVE] * 4 + [Priority.STANDARD] * 2 + [
        Priority.BATCH
    ]
    for _ in range(36):
        step.release()
        await trio.testing.wait_all_tasks_blocked()
    assert len(granted) == 43


async def test_round_robin_over_three_tenants(nursery: trio.Nursery) -> None:
    adm = admission()
    adm.set_capacity(M, 1)
    order = Order(adm, nursery)
    await order.start("hold", C)
    for name, tenant in (("a1", A), ("a2", A), ("a3", A), ("b1", B), ("b2", B), ("c1", C)):
        await order.start(name, tenant)
    # Release one at a time: each release lets exactly one waiter in.
    for _ in range(6):
        order.release.set()
        await trio.testing.wait_all_tasks_blocked()
        order.release = trio.Event()
    order.release.set()
    assert order.granted == ["hold", "a1", "b1", "c1", "a2", "b2", "a3"]


async def test_queue_full_is_immediate_and_names_the_model(autojump_clock: trio.testing.MockClock) -> None:
    adm = admission(queue_depth=2)
    adm.set_capacity(M, 0)
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(_wait_in_queue, adm)
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        with pytest.raises(QueueFull, match=M) as full:
            # The tenant holding the whole queue: its own request finds no room (another's would).
            async with adm.slot(M, A, Priority.INTERACTIVE, start + 100):
                pass
        assert trio.current_time() == start
        assert full.value.retry_after_s == 1
        nursery.cancel_scope.cancel()
    assert adm.depths()[M] == dict.fromkeys(Priority, 0)


async def _wait_in_queue(adm: Admission) -> None:
    async with adm.slot(M, A, Priority.STANDARD, FAR):
        pass


async def test_deadline_while_queued_raises_and_leaks_no_slot(autojump_clock: trio.testing.MockClock) -> None:
    adm = admission()
    adm.set_capacity(M, 1)
    async with trio.open_nursery() as nursery:
        hold = trio.Event()

        async def holder() -> None:
            async with adm.slot(M, A, Priority.STANDARD, FAR):
                await hold.wait()

        nursery.start_soon(holder)
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        with pytest.raises(DeadlineExceeded):
            async with adm.slot(M, B, Priority.STANDARD, start + 5):
                pytest.fail("granted a slot that was never free")
        assert trio.current_time() - start == pytest.approx(5)
        assert adm.depths()[M][Priority.STANDARD] == 0
        hold.set()
    stats = adm.statistics().models[M]
    assert (stats.in_use, stats.capacity) == (0, 1)
    async with adm.slot(M, B, Priority.STANDARD, trio.current_time() + 1) as queued:
        assert queued == 0


async def test_a_cancelled_waiter_leaves_the_queue(autojump_clock: trio.testing.MockClock) -> None:
    adm = admission()
    adm.set_capacity(M, 1)
    got: list[str] = []
    async with trio.open_nursery() as nursery:
        hold = trio.Event()

        async def holder() -> None:
            async with adm.slot(M, A, Priority.STANDARD, FAR):
                await hold.wait()

        async def waiter(name: str, scope_out: list[trio.CancelScope]) -> None:
            with trio.CancelScope() as scope:
                scope_out.append(scope)
                async with adm.slot(M, B, Priority.STANDARD, FAR):
                    got.append(name)

        nursery.start_soon(holder)
        await trio.testing.wait_all_tasks_blocked()
        scopes: list[trio.CancelScope] = []
        nursery.start_soon(waiter, "cancelled", scopes)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(waiter, "next", [])
        await trio.testing.wait_all_tasks_blocked()
        scopes[0].cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert adm.depths()[M][Priority.STANDARD] == 1
        hold.set()
    assert got == ["next"]
    assert adm.statistics().models[M].in_use == 0


async def test_cancelled_in_the_step_it_was_granted_hands_the_slot_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm = admission()
    adm.set_capacity(M, 1)
    got: list[str] = []
    async with trio.open_nursery() as nursery:
        hold = trio.Event()
        scope = trio.CancelScope()

        async def holder() -> None:
            async with adm.slot(M, A, Priority.STANDARD, FAR):
                await hold.wait()
                # Cancel the first waiter; before it runs again, this slot is freed and granted to it.
                scope.cancel()

        async def waiter(name: str, cancel_scope: trio.CancelScope) -> None:
            with cancel_scope:
                async with adm.slot(M, B, Priority.STANDARD, FAR):
                    got.append(name)
                    await trio.sleep(1)

        nursery.start_soon(holder)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(waiter, "cancelled", scope)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(waiter, "next", trio.CancelScope())
        await trio.testing.wait_all_tasks_blocked()
        hold.set()
    assert got == ["next"]
    assert adm.statistics().models[M].in_use == 0


async def test_capacity_growth_grants_waiters(nursery: trio.Nursery) -> None:
    adm = admission()
    adm.set_capacity(M, 0)
    order = Order(adm, nursery)
    for name in ("a1", "a2", "a3"):
        await order.start(name, A)
    assert order.granted == []
    adm.set_capacity(M, 2)
    await trio.testing.wait_all_tasks_blocked()
    assert sorted(order.granted) == ["a1", "a2"]  # both woken in one step: trio runs them in any order
    adm.set_capacity(M, 1)  # shrinking takes nothing away
    assert adm.statistics().models[M].in_use == 2
    order.release.set()
    await trio.testing.wait_all_tasks_blocked()
    assert order.granted[2] == "a3"
    assert adm.statistics().models[M].in_use == 0


async def test_queue_time_is_reported(autojump_clock: trio.testing.MockClock) -> None:
    metrics = Metrics()
    adm = Admission(GatewayConfig(), metrics)
    adm.set_capacity(M, 0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_grow_later, adm)
        async with adm.slot(M, A, Priority.STANDARD, trio.current_time() + 60) as queued:
            assert queued == pytest.approx(3)
    assert metrics.registry.get_sample_value("nexa_gateway_queue_seconds_count", {"model": M}) == 1
    assert metrics.registry.get_sample_value("nexa_gateway_queue_depth", {"model": M, "priority": "standard"}) == 0


async def _grow_later(adm: Admission) -> None:
    await trio.sleep(3)
    adm.set_capacity(M, 1)


async def test_a_tenant_flooding_the_queue_gives_way_to_another_tenant(autojump_clock: trio.testing.MockClock) -> None:
    adm = admission(queue_depth=8)  # queue_tenant_share 0.5: a tenant may hold 4 places while others wait
    adm.set_capacity(M, 0)
    outcomes: dict[str, str] = {}

    async def request(name: str, tenant: TenantId, priority: Priority = Priority.STANDARD) -> None:
        try:
            async with adm.slot(M, tenant, priority, FAR):
                outcomes[name] = "served"
        except QueueFull:
            outcomes[name] = "queue_full"

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(request, f"a{i}", A)
            await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(QueueFull):  # A's ninth finds the queue full: A alone cannot grow past it
            async with adm.slot(M, A, Priority.STANDARD, FAR):
                pass
        for i in range(5):
            nursery.start_soon(request, f"b{i}", B, Priority.BATCH)
            await trio.testing.wait_all_tasks_blocked()
        # B's first four took A's newest places; its fifth finds A at its share and is refused.
        assert outcomes == {"a7": "queue_full", "a6": "queue_full", "a5": "queue_full", "a4": "queue_full"} | {
            "b4": "queue_full"
        }
        assert sum(adm.depths()[M].values()) == 8
        # C finds both at their share: refused, nobody displaced.
        with pytest.raises(QueueFull):
            async with adm.slot(M, C, Priority.INTERACTIVE, FAR):
                pass
        adm.set_capacity(M, 8)
        await trio.testing.wait_all_tasks_blocked()
    assert sorted(n for n, o in outcomes.items() if o == "served") == ["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]
    assert adm.statistics().models[M] == ModelAdmission(capacity=8, in_use=0, waiting=dict.fromkeys(Priority, 0))


async def test_a_displaced_waiter_cancelled_in_the_same_turn_leaks_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm = admission(queue_depth=2)
    adm.set_capacity(M, 0)
    victim_scope = trio.CancelScope()

    async def victim() -> None:
        with victim_scope:
            await _wait_in_queue_as(adm, A)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_wait_in_queue_as, adm, A)
        await trio.testing.wait_all_tasks_blocked()  # trio runs new tasks in no fixed order
        nursery.start_soon(victim)
        await trio.testing.wait_all_tasks_blocked()
        # B displaces A's newest waiter, which is cancelled before it runs again (either order).
        nursery.start_soon(_wait_in_queue_as, adm, B)
        victim_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert adm.depths()[M] == {Priority.INTERACTIVE: 0, Priority.STANDARD: 2, Priority.BATCH: 0}
        adm.set_capacity(M, 2)
        await trio.testing.wait_all_tasks_blocked()
    assert adm.statistics().models[M] == ModelAdmission(capacity=2, in_use=0, waiting=dict.fromkeys(Priority, 0))


async def _wait_in_queue_as(adm: Admission, tenant: TenantId) -> None:
    async with adm.slot(M, tenant, Priority.STANDARD, FAR):
        pass
