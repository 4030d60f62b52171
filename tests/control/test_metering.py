"""Metering on a real store: batched writes, the flush on shutdown, usage by tenant/model/UTC day,
CSV export, the in-memory windows rollouts read, and the Prometheus metrics."""

from __future__ import annotations

import csv
import io
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

from nexa.config import GatewayConfig, Seconds, StoreConfig
from nexa.contracts.domain import TenantId
from nexa.contracts.gateway import UsageRecord as Rec
from nexa.contracts.usage import UsageReport, UsageRow
from nexa.control import store as st
from nexa.control.datapath.metering import CSV_HEADER, FIRST_PRUNE_S, MAX_TOKEN_COUNT, Meter
from nexa.errors import StoreError
from nexa.telemetry import Metrics
from tests.support.postgres import pg_url_fixture, postgres_fixture, store_cfg_fixture  # noqa: F401
from tests.support.usage import stored_count, usage_record

#: 2023-11-14 22:13:20 UTC; the next UTC midnight is MIDNIGHT.
T0 = 1_700_000_000.0
MIDNIGHT = (T0 // 86_400 + 1) * 86_400


def rec(n: int, **changes: object) -> Rec:
    return usage_record(**{"request_id": f"req{n}", "finished_at": T0, **changes})


@pytest.fixture
async def store(tmp_path: Path, store_cfg: StoreConfig) -> AsyncIterator[st.Store]:
    async with st.open_store(tmp_path / "state", store_cfg) as opened:
        yield opened


async def test_records_are_written_in_batches(
    tmp_path: Path, mock_clock: trio.testing.MockClock, store_cfg: StoreConfig
) -> None:
    metrics = Metrics()

    def flushes() -> float | None:
        return metrics.registry.get_sample_value("nexa_metering_flush_duration_seconds_count")

    # An inline store: its transactions run in this thread, so virtual time steps only when we say so.
    async with st.open_store(tmp_path / "state", store_cfg, inline=True) as store, trio.open_nursery() as nursery:
        meter = Meter(GatewayConfig(metering_flush_s=Seconds(1.0)), store, metrics)
        await nursery.start(meter.run)
        for i in range(250):
            meter.record(rec(i))
        await trio.testing.wait_all_tasks_blocked()
        assert await stored_count(store) == 0  # nothing is written on the hot path
        mock_clock.jump(1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert (await stored_count(store), flushes()) == (250, 1)  # one transaction for the batch
        for i in range(10):
            meter.record(rec(1000 + i))
        mock_clock.jump(0.5)
        await trio.testing.wait_all_tasks_blocked()
        assert await stored_count(store) == 250
        mock_clock.jump(0.5)
        await trio.testing.wait_all_tasks_blocked()
        assert (await stored_count(store), flushes()) == (260, 2)
        nursery.cancel_scope.cancel()


async def test_a_clean_shutdown_flushes_what_is_pending(tmp_path: Path, store_cfg: StoreConfig) -> None:
    state = tmp_path / "state"
    metrics = Metrics()
    async with st.open_store(state, store_cfg) as store:
        meter = Meter(GatewayConfig(metering_flush_s=Seconds(3600)), store, metrics)
        async with trio.open_nursery() as nursery:
            await nursery.start(meter.run)
            for i in range(7):
                meter.record(rec(i))
            assert metrics.registry.get_sample_value("nexa_metering_pending") == 7
            nursery.cancel_scope.cancel()
        assert metrics.registry.get_sample_value("nexa_metering_pending") == 0
    async with st.open_store(state, store_cfg) as store:
        assert await stored_count(store) == 7


async def test_usage_groups_by_tenant_model_and_utc_day(store: st.Store) -> None:
    meter = Meter(GatewayConfig(), store, Metrics())
    meter.record(rec(1, finished_at=MIDNIGHT - 0.5))  # the last second of the day
    meter.record(rec(2, finished_at=MIDNIGHT - 3600, status="runtime_failed", completion_tokens=0))
    meter.record(rec(3, finished_at=MIDNIGHT))  # the first instant of the next day
    meter.record(rec(4, finished_at=MIDNIGHT + 10, tenant=TenantId("beta"), model_version="2"))
    meter.record(rec(5, finished_at=MIDNIGHT + 20, model="", model_version="", deployment="", status="queue_full"))
    meter.record(rec(6, finished_at=MIDNIGHT + 86_400))  # outside the range asked for below
    report = await meter.usage(since=MIDNIGHT - 86_400, until=MIDNIGHT + 86_400)  # flushes first
    assert report.rows == [
        UsageRow(
            tenant=TenantId("acme"),
            model="llama:1",
            day="2023-11-14",
            requests=2,
            errors=1,
            prompt_tokens=20,
            completion_tokens=20,
        ),
        UsageRow(
            tenant=TenantId("acme"),
            model="chat",  # never resolved: the alias asked for
            day="2023-11-15",
            requests=1,
            errors=1,
            prompt_tokens=10,
            completion_tokens=20,
        ),
        UsageRow(
            tenant=TenantId("acme"),
            model="llama:1",
            day="2023-11-15",
            requests=1,
            errors=0,
            prompt_tokens=10,
            completion_tokens=20,
        ),
        UsageRow(
            tenant=TenantId("beta"),
            model="llama:2",
            day="2023-11-15",
            requests=1,
            errors=0,
            prompt_tokens=10,
            completion_tokens=20,
        ),
    ]
    only_beta = await meter.usage(since=0, until=1e12, tenant="beta")
    assert [r.tenant for r in only_beta.rows] == ["beta"]
    by_version = await meter.usage(since=0, until=1e12, model="llama:2")
    assert [(r.model, r.requests) for r in by_version.rows] == [("llama:2", 1)]
    by_name = await meter.usage(since=0, until=1e12, model="llama")
    assert sum(r.requests for r in by_name.rows) == 5


async def test_usage_rows_hold_no_payload(store: st.Store) -> None:
    meter = Meter(GatewayConfig(), store, Metrics())
    meter.record(rec(1))
    await meter.flush()

    def columns(db: st.Db) -> list[str]:
        if store.backend == "postgresql":
            sql = "SELECT ordinal_position, column_name FROM information_schema.columns WHERE table_name = 'usage'"
            return [row[1] for row in db.execute(sql)]
        return [row[1] for row in db.execute("PRAGMA table_info(usage)")]

    stored = set(await store.run(columns))
    assert {"tenant", "prompt_tokens", "completion_tokens"} <= stored
    assert not {"prompt", "output", "payload", "messages", "body"} & stored


def test_csv_has_a_header_and_escapes_fields() -> None:
    report = UsageReport(
        since=0,
        until=1,
        rows=[
            UsageRow(
                tenant=TenantId("acme"),
                model='odd,"model":1',
                day="2023-11-14",
                requests=3,
                errors=1,
                prompt_tokens=7,
                completion_tokens=9,
            )
        ],
    )
    text = Meter.to_csv(report)
    assert text.splitlines()[0] == ",".join(CSV_HEADER)
    assert '"odd,""model"":1"' in text
    parsed = list(csv.reader(io.StringIO(text)))
    assert parsed[1] == ["acme", 'odd,"model":1', "2023-11-14", "3", "1", "7", "9"]
    assert Meter.to_csv(UsageReport(since=0, until=1, rows=[])).splitlines() == [",".join(CSV_HEADER)]


async def test_window_stats_split_canary_and_compute_p95(store: st.Store) -> None:
    meter = Meter(GatewayConfig(), store, Metrics())
    for i in range(100):  # stable: 1..100 ms, 5 errors
        meter.record(rec(i, duration_ms=float(i + 1), finished_at=T0 - 30, status="ok" if i >= 5 else "runtime_failed"))
    for i in range(20):  # canary: 20 at 500 ms, 2 errors
        meter.record(rec(1000 + i, canary=True, duration_ms=500.0, finished_at=T0 - 10, status="ok" if i else "x"))
    meter.record(rec(2000, canary=True, duration_ms=9.0, finished_at=T0 - 600))  # too old for a 60 s window
    meter.record(rec(3000, deployment="other"))
    stable = meter.window("chat-prod", canary=False, seconds=60, now=T0)
    assert (stable.requests, stable.errors, stable.p95_ms) == (100, 5, 95.0)
    assert stable.error_rate == pytest.approx(0.05)
    canary = meter.window("chat-prod", canary=True, seconds=60, now=T0)
    assert (canary.requests, canary.errors, canary.p95_ms) == (20, 1, 500.0)
    everything = meter.window("chat-prod", canary=None, seconds=3600, now=T0)
    assert everything.requests == 121
    empty = meter.window("nothing", canary=None, seconds=60, now=T0)
    assert (empty.requests, empty.p95_ms, empty.error_rate) == (0, None, 0.0)


async def test_prometheus_metrics(store: st.Store) -> None:
    metrics = Metrics()
    meter = Meter(GatewayConfig(), store, metrics)
    meter.record(rec(1))
    meter.record(rec(2, status="runtime_failed", ttft_ms=None, completion_tokens=0))
    get = metrics.registry.get_sample_value
    assert get("nexa_gateway_requests_total", {"model": "chat", "tenant": "acme", "status": "ok"}) == 1
    assert get("nexa_gateway_requests_total", {"model": "chat", "tenant": "acme", "status": "runtime_failed"}) == 1
    assert get("nexa_gateway_tokens_total", {"model": "chat", "kind": "prompt"}) == 20
    assert get("nexa_gateway_tokens_total", {"model": "chat", "kind": "completion"}) == 20
    assert get("nexa_gateway_tenant_tokens_total", {"tenant": "acme", "kind": "prompt"}) == 20
    assert get("nexa_gateway_tenant_tokens_total", {"tenant": "acme", "kind": "completion"}) == 20
    assert get("nexa_gateway_request_duration_seconds_count", {"model": "chat"}) == 2
    assert get("nexa_gateway_time_to_first_token_seconds_count", {"model": "chat"}) == 1
    await meter.flush()
    assert get("nexa_metering_flush_duration_seconds_count") == 1


class _FailingOnce:
    """A real store that fails the next transaction once (fault injection)."""

    def __init__(self, store: st.Store) -> None:
        self.store = store
        self.fail = True

    async def run(self, fn: object, *args: object) -> object:
        if self.fail:
            self.fail = False
            raise StoreError("store failure: injected")
        return await self.store.run(fn, *args)  # type: ignore[arg-type]


async def test_a_failed_flush_keeps_the_records_for_the_next_one(store: st.Store) -> None:
    flaky = _FailingOnce(store)
    meter = Meter(GatewayConfig(), flaky, Metrics())  # type: ignore[arg-type]
    for i in range(3):
        meter.record(rec(i))
    with pytest.raises(StoreError):
        await meter.flush()
    meter.record(rec(3))
    assert await meter.flush() == 4
    assert await stored_count(store) == 4


async def test_records_past_their_retention_are_pruned_in_batches(
    tmp_path: Path, mock_clock: trio.testing.MockClock, store_cfg: StoreConfig
) -> None:
    """Old records go (in several transactions when there are many), recent ones stay."""
    now = time.time()
    cfg = GatewayConfig(metering_flush_s=Seconds(1.0), usage_retention_s=Seconds(86400.0))
    async with st.open_store(tmp_path / "state", store_cfg, inline=True) as store, trio.open_nursery() as nursery:
        old = [rec(i, finished_at=now - 2 * 86400) for i in range(st.PRUNE_BATCH + 7)]
        await store.run(st.insert_usage, [*old, rec(99_999, finished_at=now - 60)])
        meter = Meter(cfg, store, Metrics())
        await nursery.start(meter.run)
        mock_clock.jump(FIRST_PRUNE_S - 1)
        await trio.testing.wait_all_tasks_blocked()
        assert await stored_count(store) == st.PRUNE_BATCH + 8  # not yet: the first pass waits a minute
        mock_clock.jump(2)
        await trio.testing.wait_all_tasks_blocked()
        assert await stored_count(store) == 1
        nursery.cancel_scope.cancel()


# --- figures out of range (issue 12 §3) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "completion", "stored"),
    [
        (2**63, 2**64, (MAX_TOKEN_COUNT, MAX_TOKEN_COUNT)),  # bound as int64, they ended the controller
        (10**30, 5, (MAX_TOKEN_COUNT, 5)),
        (-1, -(2**63), (0, 0)),  # Prometheus refused these, and the record was lost
        (2**31 + 1, 7, (MAX_TOKEN_COUNT, 7)),
    ],
)
async def test_token_counts_out_of_range_are_clamped_counted_and_still_metered(
    store: st.Store, prompt: int, completion: int, stored: tuple[int, int]
) -> None:
    metrics = Metrics()
    meter = Meter(GatewayConfig(), store, metrics)
    meter.record(rec(1, prompt_tokens=prompt, completion_tokens=completion))
    meter.record(rec(2))
    assert await meter.flush() == 2  # no OverflowError: the flush (and the controller) go on
    [row] = await store.run(st.usage_report, 0.0, 1e12, None, None)
    assert row.requests == 2
    assert (row.prompt_tokens, row.completion_tokens) == (stored[0] + 10, stored[1] + 20)
    get = metrics.registry.get_sample_value
    assert get("nexa_usage_records_refused_total", {"reason": "tokens_out_of_range"}) == 1
    assert get("nexa_gateway_tokens_total", {"model": "chat", "kind": "prompt"}) == stored[0] + 10


async def test_timings_that_are_not_finite_are_zeroed_and_the_record_kept(store: st.Store) -> None:
    metrics = Metrics()
    meter = Meter(GatewayConfig(), store, metrics)
    meter.record(rec(1, duration_ms=float("nan"), queue_ms=float("inf"), ttft_ms=-1.0))
    assert await meter.flush() == 1
    assert await stored_count(store) == 1
    assert metrics.registry.get_sample_value("nexa_usage_records_refused_total", {"reason": "timing_invalid"}) == 1
