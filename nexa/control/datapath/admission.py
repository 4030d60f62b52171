"""Admission: bounded per-model queues in front of a model's request slots.

A model has `capacity` slots (Ready replicas * `max_inflight_per_replica`, set by the gateway).
A request takes a free slot at once unless someone of equal or higher priority is waiting;
otherwise it waits — at most `queue_depth` requests per model, beyond that `QueueFull` at once.
Slots are granted across the priority classes that wait by their weights (smooth weighted
round-robin: of every 7 grants while all three wait, 4 go to interactive, 2 to standard, 1 to
batch; `Priority.weight`), so a higher class goes first and no class starves, and within one
class round-robin over the tenants that wait (each tenant first-in first-out), so one tenant's
burst cannot starve another tenant, of its class or of a lower one (a tenant's interactive flood
slows another's standard requests, it cannot hold them past their deadline). Which class a
request may ask for is its key's grant (checked before admission, `inference.InferenceApp`).
Nor can one tenant's burst fill the queue against the others:
when the queue is full, a request of a tenant below its share (`queue_tenant_share` of
`queue_depth`) takes the place of the newest, lowest-priority waiter of the tenant holding the
most places, if that tenant holds more than its share (the displaced waiter gets QueueFull).
Waiters sleep on their own `trio.Event`: no polling. Times are on the trio clock.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from typing import Final

import attrs
import trio

from nexa.config import GatewayConfig
from nexa.contracts.domain import TenantId
from nexa.contracts.gateway import Priority
from nexa.errors import DeadlineExceeded, QueueFull
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

#: What `QueueFull` suggests: queues move at the pace of requests, which is sub-second to seconds.
QUEUE_FULL_RETRY_S: Final = 1.0
_BY_RANK: Final = sorted(Priority, key=lambda p: p.rank)


@attrs.define(eq=False)
class _Waiter:
    tenant: TenantId
    priority: Priority
    event: trio.Event = attrs.Factory(trio.Event)
    granted: bool = False
    #: Its place went to another tenant's request (see the module docstring).
    displaced: bool = False


@attrs.frozen(kw_only=True)
class ModelAdmission:
    capacity: int
    in_use: int
    waiting: dict[Priority, int]


@attrs.frozen(kw_only=True)
class AdmissionStatistics:
    """A snapshot of every model's slots and queue."""

    models: dict[str, ModelAdmission]


class _ModelQueue:
    def __init__(self, model_key: str, metrics: Metrics) -> None:
        # The model's metric children, bound once with the queue (not per request).
        self.queued_seconds = metrics.gateway_queue_seconds.labels(model_key)
        self.displaced = metrics.gateway_queue_displaced.labels(model_key)
        self.depth_gauges = {p: metrics.gateway_queue_depth.labels(model_key, p.value) for p in Priority}
        self.capacity = 0
        self.in_use = 0
        self.depth = 0
        #: Per priority: tenant → its waiters, tenants in round-robin order (next to serve first).
        self.waiting: dict[Priority, OrderedDict[TenantId, deque[_Waiter]]] = {p: OrderedDict() for p in Priority}
        self.counts: dict[Priority, int] = dict.fromkeys(Priority, 0)
        #: Places each tenant holds, all priorities together (tenants with none are absent).
        self.held: dict[TenantId, int] = {}
        #: Smooth weighted round-robin across classes: each class's current credit.
        self.credit: dict[Priority, int] = dict.fromkeys(Priority, 0)

    def _count(self, waiter: _Waiter, n: int) -> None:
        self.counts[waiter.priority] += n
        self.depth += n
        held = self.held.get(waiter.tenant, 0) + n
        if held:
            self.held[waiter.tenant] = held
        else:
            del self.held[waiter.tenant]

    def waits_at_or_above(self, priority: Priority) -> bool:
        return any(self.counts[p] for p in _BY_RANK[: priority.rank + 1])

    def push(self, waiter: _Waiter) -> None:
        tenants = self.waiting[waiter.priority]
        queue = tenants.get(waiter.tenant)
        if queue is None:
            queue = tenants[waiter.tenant] = deque()  # a new tenant joins the end of the rotation
        queue.append(waiter)
        self._count(waiter, 1)

    def remove(self, waiter: _Waiter) -> None:
        """Take out a waiter that gave up (deadline, cancellation) before it was granted."""
        tenants = self.waiting[waiter.priority]
        queue = tenants[waiter.tenant]
        queue.remove(waiter)
        if not queue:
            del tenants[waiter.tenant]
        self._count(waiter, -1)

    def pop_newest(self, tenant: TenantId) -> _Waiter | None:
        """Take out the tenant's waiter that would be served last: its newest of the lowest priority."""
        for priority in reversed(_BY_RANK):
            tenants = self.waiting[priority]
            queue = tenants.get(tenant)
            if queue:
                waiter = queue.pop()
                if not queue:
                    del tenants[tenant]
                self._count(waiter, -1)
                return waiter
        return None

    def _next_class(self) -> Priority | None:
        """The class whose turn it is (smooth weighted round-robin over the classes that wait): each
        adds its weight to its credit, the richest (the higher on a tie) goes and pays the total."""
        waiting = [p for p in _BY_RANK if self.waiting[p]]
        for p in Priority:
            if p not in waiting:
                self.credit[p] = 0  # a class that waits again starts afresh
        if not waiting:
            return None
        for p in waiting:
            self.credit[p] += p.weight
        chosen = max(waiting, key=lambda p: (self.credit[p], -p.rank))
        self.credit[chosen] -= sum(p.weight for p in waiting)
        return chosen

    def pop_next(self) -> _Waiter | None:
        priority = self._next_class()
        if priority is None:
            return None
        tenants = self.waiting[priority]
        tenant, queue = next(iter(tenants.items()))
        waiter = queue.popleft()
        if queue:
            tenants.move_to_end(tenant)  # this tenant had its turn
        else:
            del tenants[tenant]
        self._count(waiter, -1)
        return waiter


class Admission:
    """Per-model slots and priority queues; see the module docstring for the order."""

    def __init__(self, cfg: GatewayConfig, metrics: Metrics) -> None:
        self._cfg = cfg
        self._metrics = metrics
        self._queues: dict[str, _ModelQueue] = {}

    def _queue(self, model_key: str) -> _ModelQueue:
        queue = self._queues.get(model_key)
        if queue is None:
            queue = self._queues[model_key] = _ModelQueue(model_key, self._metrics)
        return queue

    @contextlib.asynccontextmanager
    async def slot(self, model_key: str, tenant: TenantId, priority: Priority, deadline: float) -> AsyncIterator[float]:
        """Hold one of the model's slots for the body of the `async with`; yields the seconds spent queued.

        Raises QueueFull at once when `queue_depth` requests already wait for this model, and
        DeadlineExceeded when `deadline` (trio clock) passes while queued. A cancelled waiter
        leaves the queue; a slot granted to it in the meantime is handed on.
        """
        queue = self._queue(model_key)
        if queue.in_use < queue.capacity and not queue.waits_at_or_above(priority):
            queue.in_use += 1
            queued = 0.0
        else:
            queued = await self._wait(model_key, queue, tenant, priority, deadline)
        queue.queued_seconds.observe(queued)
        try:
            yield queued
        finally:
            queue.in_use -= 1
            self._grant(model_key, queue)

    async def _wait(
        self, model_key: str, queue: _ModelQueue, tenant: TenantId, priority: Priority, deadline: float
    ) -> float:
        if queue.depth >= self._cfg.queue_depth and not self._displace(model_key, queue, tenant):
            raise QueueFull(
                f"the queue for model {model_key} is full ({queue.depth} requests waiting); retry later",
                retry_after_s=QUEUE_FULL_RETRY_S,
            )
        waiter = _Waiter(tenant=tenant, priority=priority)
        queue.push(waiter)
        self._gauge(model_key, queue, priority)
        start = trio.current_time()
        try:
            with trio.move_on_at(deadline) as timer:
                await waiter.event.wait()
        except BaseException:
            # Cancelled from outside (client gone, workload cancelled, shutdown).
            self._give_up(model_key, queue, waiter)
            raise
        if waiter.displaced:
            raise QueueFull(
                f"the queue for model {model_key} is full and this tenant holds more than its share of it; retry later",
                retry_after_s=QUEUE_FULL_RETRY_S,
            )
        if timer.cancelled_caught:
            self._give_up(model_key, queue, waiter)
            raise DeadlineExceeded(f"the deadline passed while waiting for a slot on model {model_key}")
        return trio.current_time() - start

    def _displace(self, model_key: str, queue: _ModelQueue, tenant: TenantId) -> bool:
        """Make room in a full queue for `tenant`, if it is below its share and another is above."""
        share = max(1, math.floor(self._cfg.queue_tenant_share * self._cfg.queue_depth))
        if queue.held.get(tenant, 0) >= share:
            return False
        others = [(held, t) for t, held in queue.held.items() if t != tenant]
        if not others:
            return False
        held, victim_tenant = max(others)
        if held <= share:
            return False
        victim = queue.pop_newest(victim_tenant)
        if victim is None:  # pragma: no cover - `held` counts only waiting places
            return False
        victim.displaced = True
        victim.event.set()
        self._gauge(model_key, queue, victim.priority)
        queue.displaced.inc()
        log.info("a waiter of tenant %s gave its place in the %s queue to tenant %s", victim_tenant, model_key, tenant)
        return True

    def _give_up(self, model_key: str, queue: _ModelQueue, waiter: _Waiter) -> None:
        if waiter.displaced:
            return  # already out of the queue
        if waiter.granted:
            # A cancellation reached us, and then, before we ran again, a slot was granted to us
            # (it is granted to whoever is first in the queue): pass it on, never leak it.
            queue.in_use -= 1
            self._grant(model_key, queue)
        else:
            queue.remove(waiter)
            self._gauge(model_key, queue, waiter.priority)

    def _grant(self, model_key: str, queue: _ModelQueue) -> None:
        while queue.in_use < queue.capacity:
            waiter = queue.pop_next()
            if waiter is None:
                return
            queue.in_use += 1
            waiter.granted = True
            waiter.event.set()
            self._gauge(model_key, queue, waiter.priority)

    def _gauge(self, model_key: str, queue: _ModelQueue, priority: Priority) -> None:
        queue.depth_gauges[priority].set(queue.counts[priority])

    def set_capacity(self, model_key: str, slots: int) -> None:
        """Set a model's slots (Ready replicas * max_inflight_per_replica). Growing grants waiters.

        Shrinking takes nothing away from requests holding a slot; with 0, waiters keep waiting
        until their deadline (a replica may become Ready meanwhile).
        """
        queue = self._queue(model_key)
        slots = max(0, slots)
        if slots == queue.capacity:
            return  # the usual request: the fleet did not change since the last one
        queue.capacity = slots
        self._grant(model_key, queue)

    def depths(self) -> dict[str, dict[Priority, int]]:
        """Requests waiting, per model and priority."""
        return {key: dict(queue.counts) for key, queue in self._queues.items()}

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(
            models={
                key: ModelAdmission(capacity=queue.capacity, in_use=queue.in_use, waiting=dict(queue.counts))
                for key, queue in self._queues.items()
            }
        )
