"""Tenant quotas: concurrent requests, requests and tokens per sliding minute, tokens per UTC day
(in all, and per LoRA adapter).

Limits are authoritative in memory and written through to the store (audited `quota.set`). The
counters live in memory only and cost O(1) amortised per request: one bucket per whole second in
a deque, pruned as the minute slides. They survive a controller restart by being rebuilt at load
from the durable usage rows, which metering writes in batches; a crash therefore forgets at most
one metering batch window (`gateway.metering_flush_s`) of counts, and requests that were running
at the crash. A clean shutdown forgets nothing that finished.

Time is wall-clock Unix seconds (`now` is passed in, so tests inject it); the day is the UTC day.
Windows are counted in whole seconds and conservatively: a request or token counts against the
minute for at least 60 s and at most 61 s.

Tokens are reserved when a request is admitted (the gateway's estimate: prompt plus the most it
may generate) and settled when it finishes: the reservation is taken back from the second it was
counted in (unless that has left the window already) and the tokens really used are counted at
the finish. A request is admitted while the counted tokens, reservations of running requests
included, are below the limit, so concurrent requests overshoot a token limit by at most one
reservation, never by one per request.

Several controllers on one store (DESIGN §5; `follow.ChangeFeed` calls `share` and `refresh_day`):
each gateway enforces its share of the concurrency and per-minute limits, the limit split among
the live controllers (the remainder to the first by id; at least 1 each, so a limit below the
number of controllers admits up to one request per controller). Otherwise the shares add up to
the limit, so the tenant is never admitted over it in total; but a tenant whose requests reach
the controllers unevenly is refused at a busy one below its limit: the ingress should balance
round-robin. The day's token budget (and media budgets) are not split: each refresh re-reads the day's total from the
usage rows of every controller and adds what this process counts that the rows may not hold yet
(reservations of running requests, tokens finished within `unflushed_s`). On the embedded store
nothing of this runs: one controller, whole limits.

Media requests count against their tenant's daily limit in their capability's unit
(`MEDIA_UNITS`: `audio_seconds_per_day`, `speech_characters_per_day`, `images_per_day`): what is
known at admission (a WAV upload's length, the speech's characters, the images asked for) is
reserved, and settled to what the call was metered for when it finishes, like tokens. A media
request is admitted while the day's use is below the limit. Several controllers: each refresh
re-reads the day's media use from the usage rows and adds this process's running reservations
(use finished here within the last metering window is not added: it may go uncounted for up to
`gateway.metering_flush_s`).

A tenant may also limit the tokens per UTC day of a LoRA adapter (`adapter_tokens_per_day`, by the
adapter's registry model name: all its versions), on top of its day's total: a request the alias
of an adapter answers reserves and settles against both, and is admitted while both are below
their limits. It is counted, rebuilt and refreshed with the day's total (the usage rows' `adapter`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Final

import attrs
import trio

from nexa.contracts.domain import Actor, KeyId, TenantId
from nexa.contracts.gateway import MEDIA_UNITS
from nexa.contracts.usage import QuotaLimits, QuotaList, QuotaUse, QuotaView, quota_problems
from nexa.control import store as st
from nexa.control.access.accounts import audit_draft
from nexa.errors import ContractError, NotFound, QuotaExceeded
from nexa.telemetry import Metrics

#: The sliding window of the per-minute limits, in seconds.
MINUTE_S: Final = 60
DAY_S: Final = 86_400
#: What a refusal of `concurrent` suggests: a slot frees when any running request ends.
CONCURRENT_RETRY_S: Final = 1.0
#: Several controllers: tokens finished here this recently count from memory at a day refresh,
#: as the usage rows may not hold them yet (metering writes every `gateway.metering_flush_s`).
UNFLUSHED_S: Final = 5.0

_NO_LIMITS: Final = QuotaLimits()


class _Window:
    """Counts over a sliding minute, in one bucket per whole second. O(1) amortised per add."""

    __slots__ = ("_buckets", "total")

    def __init__(self) -> None:
        self._buckets: deque[list[int]] = deque()  # [second, count], oldest first
        self.total = 0

    def add(self, now: float, n: int) -> int:
        """Count `n` now; returns the second of the bucket it went into (for `take_back`)."""
        second = math.floor(now)
        if self._buckets and self._buckets[-1][0] >= second:
            # Same second (or a clock that stepped back): join the newest bucket.
            self._buckets[-1][1] += n
            second = self._buckets[-1][0]
        else:
            self._buckets.append([second, n])
        self.total += n
        return second

    def take_back(self, second: int, n: int) -> None:
        """Uncount `n` that `add` put into bucket `second`; nothing when it left the window already."""
        for bucket in reversed(self._buckets):
            if bucket[0] == second:
                taken = min(n, bucket[1])
                bucket[1] -= taken
                self.total -= taken
                return
            if bucket[0] < second:
                return

    def prune(self, now: float) -> int:
        """Drop seconds that have left the window; returns what is left."""
        buckets = self._buckets
        while buckets and _expires(buckets[0][0]) <= now:
            self.total -= buckets.popleft()[1]
        return self.total

    def frees_after(self, now: float, limit: int) -> float:
        """Seconds until the total drops below `limit` (call after `prune`)."""
        total = self.total
        for second, n in self._buckets:
            total -= n
            if total < limit:
                return _expires(second) - now
        return float(MINUTE_S)


def _expires(second: int) -> int:
    # Everything in bucket `second` happened in [second, second + 1): gone once 60 s passed for the last of it.
    return second + 1 + MINUTE_S


def _utc_day(now: float) -> int:
    return math.floor(now / DAY_S)


@attrs.define(eq=False)
class _Tenant:
    limits: QuotaLimits = _NO_LIMITS
    updated_at: float | None = None
    updated_by: KeyId | None = None
    concurrent: int = 0
    requests: _Window = attrs.Factory(_Window)
    tokens: _Window = attrs.Factory(_Window)
    day: int = 0
    tokens_today: int = 0
    #: Of `tokens_today`: the reservations of running requests admitted today (no usage row yet).
    reserved_today: int = 0
    #: Several controllers only: (wall time, tokens, adapter name or "") of requests finished here
    #: lately, which the usage rows may not hold yet (`Quotas.refresh_day`).
    recent: deque[tuple[float, int, str]] = attrs.Factory(deque)
    #: Media use today by unit (`MEDIA_UNITS`), and of it the reservations of running requests.
    units_today: dict[str, float] = attrs.Factory(dict)
    reserved_units_today: dict[str, float] = attrs.Factory(dict)
    #: Of `tokens_today`, those of requests a LoRA adapter served, by adapter name; and of them
    #: the reservations of running requests.
    adapter_tokens_today: dict[str, int] = attrs.Factory(dict)
    adapter_reserved_today: dict[str, int] = attrs.Factory(dict)

    def roll_day(self, now: float) -> None:
        day = _utc_day(now)
        if day != self.day:
            self.day, self.tokens_today, self.reserved_today = day, 0, 0
            self.recent.clear()
            self.units_today.clear()
            self.reserved_units_today.clear()
            self.adapter_tokens_today.clear()
            self.adapter_reserved_today.clear()

    def add_units(self, unit: str, amount: float, *, reserved: bool = False) -> None:
        """Count `amount` (negative: take back) of today's media use in `unit`."""
        self.units_today[unit] = max(0.0, self.units_today.get(unit, 0.0) + amount)
        if reserved:
            self.reserved_units_today[unit] = max(0.0, self.reserved_units_today.get(unit, 0.0) + amount)

    def add_adapter_tokens(self, adapter: str, tokens: int, *, reserved: bool = False) -> None:
        """Count `tokens` (negative: take back) of today's use of LoRA adapter `adapter`."""
        self.adapter_tokens_today[adapter] = max(0, self.adapter_tokens_today.get(adapter, 0) + tokens)
        if reserved:
            self.adapter_reserved_today[adapter] = max(0, self.adapter_reserved_today.get(adapter, 0) + tokens)


@attrs.define(eq=False)
class QuotaTicket:
    """One admitted request's hold on its tenant's counters; `Quotas.finish` releases it once."""

    tenant: TenantId
    admitted_at: float
    #: Tokens reserved at admission, the window bucket they went into and the UTC day they count on.
    reserved: int = 0
    reserved_second: int = 0
    reserved_day: int = 0
    finished: bool = False
    #: A media request's unit (`MEDIA_UNITS`) and the use reserved in it at admission.
    unit: str | None = None
    reserved_units: float = 0.0
    #: The LoRA adapter (its model name) the request was admitted for; its tokens count against it too.
    adapter: str | None = None


class Quotas:
    """Per-tenant limits and their live counters. `admit` and `finish` never block."""

    def __init__(
        self,
        store: st.Store,
        metrics: Metrics,
        tenant_exists: Callable[[TenantId], bool],
        records: list[st.QuotaRecord],
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._tenant_exists = tenant_exists
        self._tenants: dict[TenantId, _Tenant] = {}
        for record in records:
            self._tenants[record.tenant] = _Tenant(
                limits=record.limits, updated_at=record.updated_at, updated_by=record.updated_by
            )
        # Serialises `set`, so the in-memory limits follow the store's commit order.
        self._lock = trio.Lock()
        # Several controllers (`share`): how many are live, and this one's rank among them by id.
        self._controllers, self._rank = 1, 0
        self._shared = False

    @classmethod
    async def load(
        cls,
        store: st.Store,
        metrics: Metrics,
        tenant_exists: Callable[[TenantId], bool],
        *,
        now: float | None = None,
    ) -> Quotas:
        """Limits from the store; counters rebuilt from the usage rows of the last minute and the UTC day."""
        if now is None:
            now = time.time()
        quotas = cls(store, metrics, tenant_exists, await store.run(st.load_quotas))
        for tenant, second, requests, tokens in await store.run(st.usage_by_second, math.floor(now) - MINUTE_S):
            state = quotas._state(tenant)
            state.requests.add(second, requests)
            state.tokens.add(second, tokens)
        day = _utc_day(now)
        for (tenant, adapter), tokens in (await store.run(st.usage_tokens_since, float(day * DAY_S))).items():
            state = quotas._state(tenant)
            state.roll_day(now)
            state.tokens_today += tokens
            if adapter:
                state.add_adapter_tokens(adapter, tokens)
        for (tenant, capability), units in (await store.run(st.usage_units_since, float(day * DAY_S))).items():
            state = quotas._state(tenant)
            state.roll_day(now)
            state.add_units(_unit_of(capability), units)
        return quotas

    def _state(self, tenant: TenantId) -> _Tenant:
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant()
        return state

    # ---- the hot path --------------------------------------------------------------------------

    def admit(
        self,
        tenant: TenantId,
        now: float,
        *,
        reserve_tokens: int = 0,
        unit: str | None = None,
        reserve_units: float = 0.0,
        adapter: str | None = None,
    ) -> QuotaTicket:
        """Count one request and reserve `reserve_tokens` (a media request: `reserve_units` of its
        `unit`) against the tenant's limits, and against those of LoRA `adapter` (its model name)
        when one answers it, or raise QuotaExceeded and count nothing. `finish` settles the reservation."""
        state = self._state(tenant)
        limits = state.limits
        requests = state.requests.prune(now)
        tokens = state.tokens.prune(now)
        state.roll_day(now)
        concurrent = self._share_of(limits.concurrent_requests)
        per_minute = self._share_of(limits.requests_per_minute)
        tokens_per_minute = self._share_of(limits.tokens_per_minute)
        refusal: tuple[str, float] | None = None
        if concurrent is not None and state.concurrent >= concurrent:
            refusal = ("concurrent", CONCURRENT_RETRY_S)
        elif per_minute is not None and requests >= per_minute:
            refusal = ("requests_per_minute", state.requests.frees_after(now, per_minute))
        elif tokens_per_minute is not None and tokens >= tokens_per_minute:
            refusal = ("tokens_per_minute", state.tokens.frees_after(now, tokens_per_minute))
        elif limits.tokens_per_day is not None and state.tokens_today >= limits.tokens_per_day:
            refusal = ("tokens_per_day", (state.day + 1) * DAY_S - now)
        elif adapter is not None and state.adapter_tokens_today.get(adapter, 0) >= _adapter_limit(limits, adapter):
            refusal = ("adapter_tokens_per_day", (state.day + 1) * DAY_S - now)
        elif unit is not None and state.units_today.get(unit, 0.0) >= _media_limit(limits, unit):
            refusal = (f"{unit}_per_day", (state.day + 1) * DAY_S - now)
        if refusal is not None:
            limit, retry_after = refusal
            self._metrics.gateway_quota_refusals.labels(limit).inc()
            what = f"tokens per day quota for adapter {adapter}" if limit == "adapter_tokens_per_day" else None
            raise QuotaExceeded(
                f"tenant {tenant} has used up its {what or limit.replace('_', ' ') + ' quota'}",
                limit=limit,
                retry_after_s=max(1.0, float(math.ceil(retry_after))),
            )
        state.concurrent += 1
        state.requests.add(now, 1)
        ticket = QuotaTicket(tenant=tenant, admitted_at=now, reserved_day=state.day, adapter=adapter)
        if reserve_tokens > 0:
            ticket.reserved = reserve_tokens
            ticket.reserved_second = state.tokens.add(now, reserve_tokens)
            state.tokens_today += reserve_tokens
            state.reserved_today += reserve_tokens
            if adapter is not None:
                state.add_adapter_tokens(adapter, reserve_tokens, reserved=True)
        if unit is not None:
            ticket.unit, ticket.reserved_units = unit, reserve_units
            state.add_units(unit, reserve_units, reserved=True)
        return ticket

    def finish(self, ticket: QuotaTicket, tokens: int, now: float, *, units: float = 0.0) -> None:
        """Release the ticket's concurrency slot, take back its reservation and count the tokens it
        used (a media request: the `units` of its unit). A second call does nothing."""
        if ticket.finished:
            return
        ticket.finished = True
        state = self._state(ticket.tenant)
        state.concurrent = max(0, state.concurrent - 1)
        state.tokens.prune(now)
        state.roll_day(now)
        if ticket.reserved:
            state.tokens.take_back(ticket.reserved_second, ticket.reserved)
            if state.day == ticket.reserved_day:
                state.tokens_today = max(0, state.tokens_today - ticket.reserved)
                state.reserved_today = max(0, state.reserved_today - ticket.reserved)
                if ticket.adapter is not None:
                    state.add_adapter_tokens(ticket.adapter, -ticket.reserved, reserved=True)
        if tokens > 0:
            state.tokens.add(now, tokens)
            state.tokens_today += tokens
            if ticket.adapter is not None:
                state.add_adapter_tokens(ticket.adapter, tokens)
            if self._shared:
                state.recent.append((now, tokens, ticket.adapter or ""))
        if ticket.unit is not None:
            if state.day == ticket.reserved_day:
                state.add_units(ticket.unit, -ticket.reserved_units, reserved=True)
            state.add_units(ticket.unit, units)

    def _share_of(self, limit: int | None) -> int | None:
        """This controller's part of a concurrency or per-minute limit (the module docstring says how)."""
        if limit is None or self._controllers == 1:
            return limit
        part = limit // self._controllers + (1 if self._rank < limit % self._controllers else 0)
        return max(1, part)

    # ---- several controllers (`follow.ChangeFeed`) ----------------------------------------------

    def share(self, controllers: int, rank: int) -> None:
        """Enforce this controller's share of the concurrency and per-minute limits from now on:
        `controllers` live ones (at least 1), this one `rank`-th of them by id."""
        self._controllers = max(1, controllers)
        self._rank = min(max(0, rank), self._controllers - 1)
        self._shared = True

    async def refresh(self) -> None:
        """Re-read the limits (another controller set them); the live counters stay."""
        async with self._lock:
            for record in await self._store.read(st.load_quotas):
                state = self._state(record.tenant)
                state.limits, state.updated_at, state.updated_by = record.limits, record.updated_at, record.updated_by

    async def refresh_day(self, *, now: float | None = None, unflushed_s: float = UNFLUSHED_S) -> None:
        """The UTC day's tokens of each tenant (in all and by LoRA adapter): every controller's
        usage rows, plus this process's running reservations and the tokens it counted within
        `unflushed_s` (metering may not have written them yet; counted twice until then, never missed)."""
        if now is None:
            now = time.time()
        day = _utc_day(now)
        rows = await self._store.read(st.usage_tokens_since, float(day * DAY_S))
        for tenant in {t for t, _ in rows} | set(self._tenants):
            state = self._state(tenant)
            state.roll_day(now)
            recent = state.recent
            while recent and recent[0][0] < now - unflushed_s:
                recent.popleft()
            state.tokens_today = state.reserved_today + sum(n for _, n, _ in recent)
            state.adapter_tokens_today = dict(state.adapter_reserved_today)
            for _, n, adapter in recent:
                if adapter:
                    state.add_adapter_tokens(adapter, n)
        for (tenant, adapter), tokens in rows.items():
            state = self._state(tenant)
            state.tokens_today += tokens
            if adapter:
                state.add_adapter_tokens(adapter, tokens)
        media = await self._store.read(st.usage_units_since, float(day * DAY_S))
        for state in self._tenants.values():
            state.units_today = dict(state.reserved_units_today)
        for (tenant, capability), units in media.items():
            self._state(tenant).add_units(_unit_of(capability), units)

    # ---- management ----------------------------------------------------------------------------

    async def set(self, actor: Actor, tenant: TenantId, limits: QuotaLimits) -> QuotaView:
        """Replace a tenant's limits (None: no limit of that kind), audited as `quota.set`."""
        problems = quota_problems(limits)
        if problems:
            raise ContractError("invalid quota: " + "; ".join(problems), problems=tuple(problems))
        if not self._tenant_exists(tenant):
            raise NotFound(f"no tenant {tenant}")
        async with self._lock:
            state = self._tenants.get(tenant)
            before = state.limits if state is not None and state.updated_at is not None else None
            record = st.QuotaRecord(tenant=tenant, limits=limits, updated_at=time.time(), updated_by=actor.key_id)
            detail = ", ".join(f"{k}={v}" for k, v in attrs.asdict(limits).items())
            draft = audit_draft(actor, "quota.set", f"tenant/{tenant}", before, limits, detail=detail)
            event = await self._store.run(st.save_quota, record, draft)
            self._metrics.audit_events.labels(event.result.value).inc()
            state = self._state(tenant)
            state.limits, state.updated_at, state.updated_by = limits, record.updated_at, record.updated_by
        return self.view(tenant, record.updated_at)

    def view(self, tenant: TenantId, now: float) -> QuotaView:
        """A tenant's limits and use now. NotFound for a tenant that does not exist."""
        if not self._tenant_exists(tenant):
            raise NotFound(f"no tenant {tenant}")
        state = self._state(tenant)
        requests = state.requests.prune(now)
        tokens = state.tokens.prune(now)
        state.roll_day(now)
        return QuotaView(
            tenant=tenant,
            limits=state.limits,
            use=QuotaUse(
                concurrent_requests=state.concurrent,
                requests_last_minute=requests,
                tokens_last_minute=tokens,
                tokens_today=state.tokens_today,
                audio_seconds_today=round(state.units_today.get("audio_seconds", 0.0), 3),
                speech_characters_today=round(state.units_today.get("speech_characters", 0.0)),
                images_today=round(state.units_today.get("images", 0.0)),
                adapter_tokens_today={
                    name: state.adapter_tokens_today.get(name, 0)
                    for name in sorted(state.adapter_tokens_today.keys() | state.limits.adapter_tokens_per_day.keys())
                },
            ),
            updated_at=state.updated_at,
            updated_by=state.updated_by,
        )

    def all(self, now: float) -> QuotaList:
        """Every existing tenant with a quota record or any counted use, by tenant id."""
        return QuotaList(
            quotas=[self.view(tenant, now) for tenant in sorted(self._tenants) if self._tenant_exists(tenant)]
        )


def _media_limit(limits: QuotaLimits, unit: str) -> float:
    """The tenant's daily limit in a media unit (`<unit>_per_day`); infinite when it has none."""
    value = getattr(limits, f"{unit}_per_day", None)
    return value if isinstance(value, int) else math.inf


def _adapter_limit(limits: QuotaLimits, adapter: str) -> float:
    """The tenant's daily token limit for LoRA adapter `adapter`; infinite when it has none."""
    limit = limits.adapter_tokens_per_day.get(adapter)
    return math.inf if limit is None else limit


def _unit_of(capability: str) -> str:
    """The media unit a usage row's capability is metered in."""
    return next((unit for cap, unit in MEDIA_UNITS.items() if cap.value == capability), capability)
