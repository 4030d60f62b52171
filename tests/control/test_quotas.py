"""Tenant quotas on a real store: each limit refuses with its name and a Retry-After, windows slide,
counters are rebuilt from flushed usage after a restart, and changes are audited."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest

from nexa.config import GatewayConfig, StoreConfig
from nexa.contracts.api import TenantCreate
from nexa.contracts.domain import Actor, KeyId, Role, TenantId
from nexa.contracts.gateway import Api, Capability, UsageRecord
from nexa.contracts.usage import QuotaLimits
from nexa.control import store as st
from nexa.control.access.accounts import Accounts
from nexa.control.datapath.metering import Meter
from nexa.control.datapath.quotas import Quotas
from nexa.errors import ContractError, NotFound, QuotaExceeded
from nexa.telemetry import Metrics
from tests.support.postgres import pg_url_fixture, postgres_fixture, store_cfg_fixture  # noqa: F401

ADMIN = Actor(key_id=KeyId("adm"), role=Role.ADMIN)
ACME = TenantId("acme")
OTHER = TenantId("other")
#: 2023-11-14 22:13:20 UTC: far enough from midnight for minute tests.
T0 = 1_700_000_000.0


@pytest.fixture
async def store(tmp_path: Path, store_cfg: StoreConfig) -> AsyncIterator[st.Store]:
    async with st.open_store(tmp_path / "state", store_cfg) as opened:
        accounts = await Accounts.load(opened, Metrics())
        for tenant in (ACME, OTHER):
            await accounts.create_tenant(ADMIN, TenantCreate(id=tenant))
        yield opened


def exists(tenant: TenantId) -> bool:
    return tenant in {ACME, OTHER}


async def quotas_with(store: st.Store, limits: QuotaLimits, *, now: float = T0) -> Quotas:
    quotas = await Quotas.load(store, Metrics(), exists, now=now)
    await quotas.set(ADMIN, ACME, limits)
    return quotas


def usage(tenant: TenantId, finished_at: float, tokens: int, status: str = "ok") -> UsageRecord:
    return UsageRecord(
        request_id=f"r{finished_at}",
        workload_id=None,
        api=Api.OPENAI,
        tenant=tenant,
        key_id=KeyId("k1"),
        capability=Capability.CHAT,
        alias="chat",
        model="llama",
        model_version="1",
        deployment="d1",
        node_id="n1",
        status=status,
        prompt_tokens=tokens // 2,
        completion_tokens=tokens - tokens // 2,
        queue_ms=0.0,
        ttft_ms=5.0,
        duration_ms=10.0,
        finished_at=finished_at,
    )


async def test_a_tenant_without_a_quota_record_has_no_limits(store: st.Store) -> None:
    quotas = await Quotas.load(store, Metrics(), exists, now=T0)
    tickets = [quotas.admit(ACME, T0) for _ in range(1000)]
    for ticket in tickets:
        quotas.finish(ticket, 10_000, T0)
    assert quotas.view(ACME, T0).use.tokens_today == 10_000_000


async def test_concurrent_requests_refuse_until_one_finishes(store: st.Store) -> None:
    quotas = await quotas_with(store, QuotaLimits(concurrent_requests=2))
    first, _ = quotas.admit(ACME, T0), quotas.admit(ACME, T0)
    with pytest.raises(QuotaExceeded) as refused:
        quotas.admit(ACME, T0)
    assert refused.value.limit == "concurrent"
    assert refused.value.retry_after_s >= 1
    assert quotas.admit(OTHER, T0)  # another tenant is not affected
    quotas.finish(first, 0, T0)
    quotas.finish(first, 0, T0)  # idempotent: releases one slot only
    assert quotas.view(ACME, T0).use.concurrent_requests == 1
    quotas.admit(ACME, T0)
    with pytest.raises(QuotaExceeded):
        quotas.admit(ACME, T0)


async def test_requests_per_minute_slide_and_say_when_they_free_up(store: st.Store) -> None:
    quotas = await quotas_with(store, QuotaLimits(requests_per_minute=3))
    for at in (T0, T0 + 10, T0 + 20):
        quotas.finish(quotas.admit(ACME, at), 0, at)
    with pytest.raises(QuotaExceeded) as refused:
        quotas.admit(ACME, T0 + 30)
    assert refused.value.limit == "requests_per_minute"
    # The request at T0 leaves the window 60-61 s later: about 31 s from T0 + 30.
    assert 30 <= refused.value.retry_after_s <= 32
    with pytest.raises(QuotaExceeded):
        quotas.admit(ACME, T0 + 59.9)
    quotas.admit(ACME, T0 + refused.value.retry_after_s + 30)
    assert quotas.view(ACME, T0 + 62).use.requests_last_minute == 3


async def test_tokens_per_minute_count_finished_tokens(store: st.Store) -> None:
    quotas = await quotas_with(store, QuotaLimits(tokens_per_minute=1000))
    quotas.finish(quotas.admit(ACME, T0), 600, T0 + 1)
    quotas.finish(quotas.admit(ACME, T0 + 5), 500, T0 + 6)
    with pytest.raises(QuotaExceeded) as refused:
        quotas.admit(ACME, T0 + 10)
    assert refused.value.limit == "tokens_per_minute"
    # Below the limit once the 600 at T0 + 1 leave: 52-53 s after T0 + 10.
    assert 51 <= refused.value.retry_after_s <= 53
    quotas.admit(ACME, T0 + 10 + refused.value.retry_after_s)
    assert quotas.view(ACME, T0 + 63).use.tokens_last_minute == 500


async def test_tokens_per_day_reset_at_utc_midnight(store: st.Store) -> None:
    midnight = (T0 // 86_400 + 1) * 86_400
    quotas = await quotas_with(store, QuotaLimits(tokens_per_day=5000), now=midnight - 3600)
    quotas.finish(quotas.admit(ACME, midnight - 3600), 5000, midnight - 3500)
    with pytest.raises(QuotaExceeded) as refused:
        quotas.admit(ACME, midnight - 100)
    assert refused.value.limit == "tokens_per_day"
    assert refused.value.retry_after_s == 100
    quotas.admit(ACME, midnight + 1)
    assert quotas.view(ACME, midnight + 1).use.tokens_today == 0


async def test_refusal_counts_nothing_and_is_metered(store: st.Store) -> None:
    metrics = Metrics()
    quotas = await Quotas.load(store, metrics, exists, now=T0)
    await quotas.set(ADMIN, ACME, QuotaLimits(requests_per_minute=1))
    quotas.admit(ACME, T0)
    for _ in range(3):
        with pytest.raises(QuotaExceeded):
            quotas.admit(ACME, T0)
    use = quotas.view(ACME, T0).use
    assert (use.concurrent_requests, use.requests_last_minute) == (1, 1)
    assert metrics.registry.get_sample_value("nexa_gateway_quota_refusals_total", {"limit": "requests_per_minute"}) == 3


async def test_counters_are_rebuilt_from_flushed_usage_after_a_restart(tmp_path: Path, store_cfg: StoreConfig) -> None:
    state = tmp_path / "state"
    async with st.open_store(state, store_cfg) as store:
        accounts = await Accounts.load(store, Metrics())
        await accounts.create_tenant(ADMIN, TenantCreate(id=ACME))
        quotas = await Quotas.load(store, Metrics(), exists, now=T0)
        await quotas.set(ADMIN, ACME, QuotaLimits(requests_per_minute=3, tokens_per_day=10_000))
        meter = Meter(GatewayConfig(), store, Metrics())
        meter.record(usage(ACME, T0 - 7200, 4000))  # earlier today: counts for the day only
        meter.record(usage(ACME, T0 - 30, 3000))
        meter.record(usage(ACME, T0 - 20, 3000))
        meter.record(usage(ACME, T0 - 10, 0, status="quota_exceeded"))  # refused: not a request
        meter.record(usage(OTHER, T0 - 10, 50))
        assert await meter.flush() == 5
    async with st.open_store(state, store_cfg) as store:
        quotas = await Quotas.load(store, Metrics(), exists, now=T0)
        view = quotas.view(ACME, T0)
        assert view.limits == QuotaLimits(requests_per_minute=3, tokens_per_day=10_000)
        assert view.use.requests_last_minute == 2
        assert view.use.tokens_last_minute == 6000
        assert view.use.tokens_today == 10_000
        assert view.use.concurrent_requests == 0
        with pytest.raises(QuotaExceeded) as refused:
            quotas.admit(ACME, T0)
        assert refused.value.limit == "tokens_per_day"
        assert quotas.view(OTHER, T0).use.tokens_today == 50


async def test_set_is_audited_and_bad_input_changes_nothing(store: st.Store) -> None:
    quotas = await Quotas.load(store, Metrics(), exists, now=T0)
    view = await quotas.set(ADMIN, ACME, QuotaLimits(concurrent_requests=4, tokens_per_day=100))
    assert view.limits.concurrent_requests == 4
    assert view.updated_by == "adm"
    for bad in (QuotaLimits(concurrent_requests=0), QuotaLimits(tokens_per_minute=-5)):
        with pytest.raises(ContractError):
            await quotas.set(ADMIN, ACME, bad)
    with pytest.raises(NotFound):
        await quotas.set(ADMIN, TenantId("nobody"), QuotaLimits(concurrent_requests=1))
    with pytest.raises(NotFound):
        quotas.view(TenantId("nobody"), T0)
    events = await store.run(st.list_audit, st.AuditQuery(action="quota.set"))
    assert [(e.target, e.actor_key_id, e.prior_sha256) for e in events] == [("tenant/acme", "adm", None)]
    assert "concurrent_requests=4" in events[0].detail
    assert (await store.run(st.verify_audit)).ok
    # Nothing changed by the refusals, in memory or in the store.
    assert quotas.view(ACME, T0).limits == QuotaLimits(concurrent_requests=4, tokens_per_day=100)
    reloaded = await Quotas.load(store, Metrics(), exists, now=T0)
    assert reloaded.view(ACME, T0).limits == QuotaLimits(concurrent_requests=4, tokens_per_day=100)
    await quotas.set(ADMIN, ACME, QuotaLimits())
    assert [v.tenant for v in quotas.all(T0).quotas] == [ACME]
    assert quotas.all(T0).quotas[0].limits == QuotaLimits()


async def test_tokens_are_reserved_at_admission_and_settled_at_finish(store: st.Store) -> None:
    quotas = await quotas_with(store, QuotaLimits(tokens_per_minute=1000, tokens_per_day=10_000))
    ticket = quotas.admit(ACME, T0, reserve_tokens=300)
    use = quotas.view(ACME, T0).use
    assert (use.tokens_last_minute, use.tokens_today) == (300, 300)
    # It used less than it reserved: the reservation goes, the 120 used count from the finish.
    quotas.finish(ticket, 120, T0 + 30)
    use = quotas.view(ACME, T0 + 30).use
    assert (use.tokens_last_minute, use.tokens_today) == (120, 120)
    # A request that outlives the window: its reservation left with the window, its tokens count at the finish.
    late = quotas.admit(ACME, T0 + 31, reserve_tokens=500)
    quotas.finish(late, 700, T0 + 31 + 90)
    use = quotas.view(ACME, T0 + 121).use
    assert (use.tokens_last_minute, use.tokens_today) == (700, 120 + 700)
    quotas.finish(late, 700, T0 + 122)  # a second finish changes nothing
    assert quotas.view(ACME, T0 + 122).use.tokens_last_minute == 700


async def test_concurrent_requests_overshoot_a_token_limit_by_at_most_one_reservation(store: st.Store) -> None:
    limit, reservation = 1000, 130
    quotas = await quotas_with(store, QuotaLimits(tokens_per_minute=limit))
    admitted, refused = [], []
    for i in range(50):  # 50 requests arrive before any finishes
        try:
            admitted.append(quotas.admit(ACME, T0 + i * 0.01, reserve_tokens=reservation))
        except QuotaExceeded as exc:
            refused.append(exc.limit)
    assert len(admitted) == 8  # ceil(1000 / 130)
    assert refused == ["tokens_per_minute"] * 42
    for ticket in admitted:
        quotas.finish(ticket, reservation, T0 + 1)  # each uses all it reserved
    used = quotas.view(ACME, T0 + 1).use.tokens_last_minute
    assert limit <= used <= limit + reservation
    # Without reservations (tokens counted at finish only) all 50 would have been admitted.


async def test_a_refused_admission_reserves_nothing(store: st.Store) -> None:
    quotas = await quotas_with(store, QuotaLimits(concurrent_requests=1, tokens_per_minute=1000))
    quotas.admit(ACME, T0, reserve_tokens=100)
    with pytest.raises(QuotaExceeded):
        quotas.admit(ACME, T0, reserve_tokens=100)
    use = quotas.view(ACME, T0).use
    assert (use.concurrent_requests, use.requests_last_minute, use.tokens_last_minute) == (1, 1, 100)


async def test_media_limits_count_their_units_reserve_at_admission_and_settle_to_the_metered(store: st.Store) -> None:
    quotas = await quotas_with(store, QuotaLimits(images_per_day=4, audio_seconds_per_day=60))
    held = quotas.admit(ACME, T0, unit="images", reserve_units=3)
    assert quotas.view(ACME, T0).use.images_today == 3  # reserved while it runs
    quotas.finish(held, 0, T0 + 1, units=2)  # the runtime made 2
    quotas.finish(quotas.admit(ACME, T0 + 2, unit="images", reserve_units=2), 0, T0 + 3, units=2)
    with pytest.raises(QuotaExceeded) as refused:
        quotas.admit(ACME, T0 + 4, unit="images", reserve_units=1)
    assert refused.value.limit == "images_per_day"
    # Other units, and text requests, are not refused by it.
    quotas.finish(quotas.admit(ACME, T0 + 5, unit="audio_seconds", reserve_units=30.5), 0, T0 + 6, units=30.5)
    quotas.finish(quotas.admit(ACME, T0 + 7, reserve_tokens=10), 10, T0 + 8)
    use = quotas.view(ACME, T0 + 9).use
    assert (use.images_today, use.audio_seconds_today, use.speech_characters_today) == (4, 30.5, 0)


async def test_media_use_is_rebuilt_from_the_usage_rows_after_a_restart(tmp_path: Path, store_cfg: StoreConfig) -> None:
    state = tmp_path / "state"
    async with st.open_store(state, store_cfg) as store:
        accounts = await Accounts.load(store, Metrics())
        await accounts.create_tenant(ADMIN, TenantCreate(id=ACME))
        quotas = await Quotas.load(store, Metrics(), exists, now=T0)
        await quotas.set(ADMIN, ACME, QuotaLimits(speech_characters_per_day=100))
        meter = Meter(GatewayConfig(), store, Metrics())
        speech = attrs.evolve(usage(ACME, T0 - 60, 0), capability=Capability.SPEECH, units=100.0)
        transcribed = attrs.evolve(usage(ACME, T0 - 50, 0), capability=Capability.TRANSCRIPTION, units=12.5)
        meter.record(speech)
        meter.record(transcribed)
        assert await meter.flush() == 2
        [row] = await store.run(st.usage_report, T0 - 3600, T0 + 1, "acme", None)
        assert (row.audio_seconds, row.speech_characters, row.images) == (12.5, 100, 0)
    async with st.open_store(state, store_cfg) as store:
        quotas = await Quotas.load(store, Metrics(), exists, now=T0)
        use = quotas.view(ACME, T0).use
        assert (use.speech_characters_today, use.audio_seconds_today) == (100, 12.5)
        with pytest.raises(QuotaExceeded) as refused:
            quotas.admit(ACME, T0, unit="speech_characters", reserve_units=5)
        assert refused.value.limit == "speech_characters_per_day"


async def test_an_adapters_daily_tokens_refuse_it_alone_until_the_utc_day_rolls(store: st.Store) -> None:
    midnight = (T0 // 86_400 + 1) * 86_400
    start = midnight - 3600
    metrics = Metrics()
    quotas = await Quotas.load(store, metrics, exists, now=start)
    await quotas.set(ADMIN, ACME, QuotaLimits(tokens_per_day=100_000, adapter_tokens_per_day={"ner": 1000, "off": 0}))
    # Reserved against the adapter's day while it runs, settled to what it used.
    ticket = quotas.admit(ACME, start, reserve_tokens=600, adapter="ner")
    assert quotas.view(ACME, start).use.adapter_tokens_today == {"ner": 600, "off": 0}
    quotas.finish(ticket, 400, start + 1)
    quotas.finish(quotas.admit(ACME, start + 2, reserve_tokens=700, adapter="ner"), 650, start + 3)
    use = quotas.view(ACME, start + 3).use
    assert (use.tokens_today, use.adapter_tokens_today) == (1050, {"ner": 1050, "off": 0})
    with pytest.raises(QuotaExceeded) as refused:
        quotas.admit(ACME, midnight - 100, reserve_tokens=10, adapter="ner")
    assert refused.value.limit == "adapter_tokens_per_day"
    assert "acme" in str(refused.value) and "adapter ner" in str(refused.value)
    assert refused.value.retry_after_s == 100
    with pytest.raises(QuotaExceeded):
        quotas.admit(ACME, midnight - 100, adapter="off")  # a limit of 0 refuses the adapter outright
    assert (
        metrics.registry.get_sample_value("nexa_gateway_quota_refusals_total", {"limit": "adapter_tokens_per_day"}) == 2
    )
    # The refusals counted nothing; the base model, an unlimited adapter and another tenant still answer.
    assert quotas.view(ACME, midnight - 100).use.concurrent_requests == 0
    quotas.finish(quotas.admit(ACME, midnight - 90, reserve_tokens=50), 50, midnight - 89)
    quotas.finish(quotas.admit(ACME, midnight - 80, reserve_tokens=50, adapter="chat-tone"), 30, midnight - 79)
    quotas.finish(quotas.admit(OTHER, midnight - 70, adapter="ner"), 5000, midnight - 69)
    use = quotas.view(ACME, midnight - 60).use
    assert (use.tokens_today, use.adapter_tokens_today) == (1130, {"chat-tone": 30, "ner": 1050, "off": 0})
    # A new UTC day starts every adapter's count afresh.
    quotas.admit(ACME, midnight + 1, reserve_tokens=10, adapter="ner")
    assert quotas.view(ACME, midnight + 1).use.adapter_tokens_today == {"ner": 10, "off": 0}


async def test_a_reservation_of_yesterday_settles_into_today_only_what_it_used(store: st.Store) -> None:
    midnight = (T0 // 86_400 + 1) * 86_400
    quotas = await quotas_with(store, QuotaLimits(adapter_tokens_per_day={"ner": 1000}), now=midnight - 10)
    ticket = quotas.admit(ACME, midnight - 10, reserve_tokens=900, adapter="ner")
    quotas.finish(ticket, 300, midnight + 5)  # admitted yesterday, finished today
    assert quotas.view(ACME, midnight + 5).use.adapter_tokens_today == {"ner": 300}


def adapter_usage(tenant: TenantId, finished_at: float, tokens: int, adapter: str) -> UsageRecord:
    return attrs.evolve(usage(tenant, finished_at, tokens), request_id=f"a{finished_at}", adapter=adapter)


async def test_adapter_use_is_rebuilt_by_name_from_the_usage_rows_after_a_restart(
    tmp_path: Path, store_cfg: StoreConfig
) -> None:
    state = tmp_path / "state"
    async with st.open_store(state, store_cfg) as store:
        accounts = await Accounts.load(store, Metrics())
        await accounts.create_tenant(ADMIN, TenantCreate(id=ACME))
        quotas = await Quotas.load(store, Metrics(), exists, now=T0)
        await quotas.set(ADMIN, ACME, QuotaLimits(adapter_tokens_per_day={"ner": 2000}))
        meter = Meter(GatewayConfig(), store, Metrics())
        meter.record(adapter_usage(ACME, T0 - 7200, 1200, "ner:1"))
        meter.record(adapter_usage(ACME, T0 - 60, 900, "ner:2"))  # another version: the same adapter
        meter.record(adapter_usage(ACME, T0 - 50, 70, "chat-tone:1"))
        meter.record(adapter_usage(ACME, T0 - 86_400, 5000, "ner:1"))  # yesterday: not counted
        meter.record(usage(ACME, T0 - 40, 30))  # the base model
        meter.record(adapter_usage(OTHER, T0 - 30, 4000, "ner:1"))
        assert await meter.flush() == 6
    async with st.open_store(state, store_cfg) as store:
        quotas = await Quotas.load(store, Metrics(), exists, now=T0)
        use = quotas.view(ACME, T0).use
        assert (use.tokens_today, use.adapter_tokens_today) == (2200, {"chat-tone": 70, "ner": 2100})
        assert quotas.view(OTHER, T0).use.adapter_tokens_today == {"ner": 4000}
        with pytest.raises(QuotaExceeded) as refused:
            quotas.admit(ACME, T0, adapter="ner")
        assert refused.value.limit == "adapter_tokens_per_day"
        quotas.admit(ACME, T0, adapter="chat-tone")
        # Several controllers: a day refresh re-reads the rows and keeps what runs here.
        await quotas.refresh_day(now=T0)
        assert quotas.view(ACME, T0).use.adapter_tokens_today == {"chat-tone": 70, "ner": 2100}


async def test_bad_adapter_limits_are_refused_by_name_and_change_nothing(store: st.Store) -> None:
    quotas = await quotas_with(store, QuotaLimits(adapter_tokens_per_day={"ner": 10}))
    too_many = {f"a{i}": 1 for i in range(257)}
    for bad, says in (
        ({"Ner:1": 5}, "adapter_tokens_per_day['Ner:1']: 1-64 lower-case letters"),
        ({"ner": -1}, "adapter_tokens_per_day['ner']: an integer >= 0"),
        (too_many, "adapter_tokens_per_day: at most 256 adapters"),
    ):
        with pytest.raises(ContractError) as refused:
            await quotas.set(ADMIN, ACME, QuotaLimits(adapter_tokens_per_day=bad))
        assert says in str(refused.value)
    assert quotas.view(ACME, T0).limits == QuotaLimits(adapter_tokens_per_day={"ner": 10})
    reloaded = await Quotas.load(store, Metrics(), exists, now=T0)
    assert reloaded.view(ACME, T0).limits.adapter_tokens_per_day == {"ner": 10}
