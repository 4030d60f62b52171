"""The console's sessions, CSRF tokens and request charts, each checked on its own (no server).

The charts are fed by a real `Meter`: what it records is what `statistics()` hands the console,
bucket for bucket the same counts as the Prometheus histograms the console used to scrape.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from nexa.config import GatewayConfig
from nexa.contracts.domain import KeyId, Role, TenantId
from nexa.contracts.gateway import Api, Capability, UsageRecord
from nexa.control import store as st
from nexa.control.console import charts as ch
from nexa.control.console import sessions as se
from nexa.control.datapath.metering import LATENCY_BOUNDS_S, Meter
from nexa.telemetry import Metrics

NOW = 1_700_000_000.0
ADMIN = KeyId("admin0000001")
OTHER = KeyId("other0000001")


def _session(key_id: KeyId = ADMIN, *, now: float = NOW) -> se.Session:
    return se.new_session(key_id, Role.ADMIN, None, now=now)


# ---- sessions ------------------------------------------------------------------------------------


def test_a_session_is_found_by_its_id_until_it_expires() -> None:
    pool = se.Sessions(lambda _key: True)
    session = _session()
    sid = pool.add(session, now=NOW)
    assert len(sid) >= 40 and session.csrf not in sid
    assert pool.current(sid, now=NOW + 1) is session
    assert pool.current("not-an-id", now=NOW + 1) is None
    assert pool.current(sid, now=NOW + se.SESSION_TTL_S) is None  # expired: and gone
    assert len(pool) == 0


def test_a_revoked_keys_session_ends_at_its_next_lookup() -> None:
    active = {ADMIN}
    pool = se.Sessions(lambda key: key in active)
    sid = pool.add(_session(), now=NOW)
    assert pool.current(sid, now=NOW) is not None
    active.clear()
    assert pool.current(sid, now=NOW) is None
    active.add(ADMIN)
    assert pool.current(sid, now=NOW) is None  # dropped, not merely hidden
    assert len(pool) == 0


def test_dropping_a_session_ends_only_that_one() -> None:
    pool = se.Sessions(lambda _key: True)
    first, second = pool.add(_session(), now=NOW), pool.add(_session(), now=NOW)
    pool.drop(first)
    pool.drop("unknown")  # no error
    assert pool.current(first, now=NOW) is None
    assert pool.current(second, now=NOW) is not None


def test_one_key_holds_at_most_its_share_and_drops_its_own_oldest() -> None:
    pool = se.Sessions(lambda _key: True)
    other = pool.add(_session(OTHER), now=NOW)
    ids = [pool.add(_session(), now=NOW) for _ in range(se.MAX_SESSIONS_PER_KEY + 2)]
    assert len(pool) == se.MAX_SESSIONS_PER_KEY + 1
    assert [pool.current(sid, now=NOW) is None for sid in ids[:2]] == [True, True]
    assert all(pool.current(sid, now=NOW) is not None for sid in ids[2:])
    assert pool.current(other, now=NOW) is not None


def test_a_full_pool_drops_expired_sessions_first_then_the_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(se, "MAX_SESSIONS", 3)
    pool = se.Sessions(lambda _key: True)
    old = pool.add(_session(KeyId("k1"), now=NOW - se.SESSION_TTL_S), now=NOW - se.SESSION_TTL_S)
    kept = [pool.add(_session(KeyId(f"k{i}")), now=NOW) for i in (2, 3)]
    newest = pool.add(_session(KeyId("k4")), now=NOW)
    assert len(pool) == 3
    assert old not in {newest, *kept}
    assert all(pool.current(sid, now=NOW) is not None for sid in [*kept, newest])
    # Full again with live sessions only: the oldest goes.
    pool.add(_session(KeyId("k5")), now=NOW)
    assert pool.current(kept[0], now=NOW) is None
    assert len(pool) == 3


def test_a_session_acts_as_its_key() -> None:
    session = se.new_session(ADMIN, Role.OPERATOR, TenantId("acme"), now=NOW)
    actor = session.actor
    assert (actor.key_id, actor.role, actor.tenant) == (ADMIN, Role.OPERATOR, TenantId("acme"))
    assert session.expires_at == NOW + se.SESSION_TTL_S
    assert _session().csrf != _session().csrf


# ---- CSRF ----------------------------------------------------------------------------------------


def test_a_post_must_carry_its_sessions_csrf_token() -> None:
    session, other = _session(), _session()
    assert se.csrf_ok(session, session.csrf)
    for presented in ("", other.csrf, session.csrf[:-1], session.csrf + "x"):
        assert not se.csrf_ok(session, presented)


def test_a_sign_in_token_is_ours_the_cookies_and_fresh() -> None:
    forms = se.LoginForms()
    token = forms.token(NOW)
    assert forms.token_ok(token, token, NOW)
    assert forms.token_ok(token, token, NOW + se.ANON_TTL_S)
    assert not forms.token_ok(token, token, NOW + se.ANON_TTL_S + 1)  # expired
    assert not forms.token_ok(token, token, NOW - 1)  # issued in the future
    assert not forms.token_ok(token, "", NOW)  # no cookie (a cross-site post has none)
    assert not forms.token_ok(token, forms.token(NOW), NOW)  # not this form's cookie
    assert not forms.token_ok("", "", NOW)
    theirs = se.LoginForms().token(NOW)  # another process's secret (or a forger's)
    assert not forms.token_ok(theirs, theirs, NOW)


@pytest.mark.parametrize(
    "bad",
    ["no-dots", "x.nonce.mac", "..", f"{int(NOW)}.nonce.", "1" * 300, f"{int(NOW)}.n.{'0' * 64}"],
)
def test_a_malformed_sign_in_token_is_refused(bad: str) -> None:
    assert not se.LoginForms().token_ok(bad, bad, NOW)


def test_sign_in_tokens_are_unique_and_carry_their_time() -> None:
    forms = se.LoginForms()
    first, second = forms.token(NOW), forms.token(NOW)
    assert first != second
    assert first.split(".")[0] == str(int(NOW))


@pytest.mark.parametrize(
    ("scheme", "peer", "proto", "proxies", "secure"),
    [
        ("https", None, "", (), True),
        ("http", "127.0.0.1", "https", (), False),
        ("http", "127.0.0.1", "https", ("127.0.0.1",), True),
        ("http", "::ffff:127.0.0.2", "https", ("127.0.0.0/8",), True),
        ("http", "::1", "https", ("::1",), True),
        ("http", "192.0.2.7", "https", ("127.0.0.1",), False),
        ("http", "127.0.0.1", "https, http", ("127.0.0.1",), False),
        ("http", "127.0.0.1", "http, HTTPS ", ("127.0.0.1",), True),
        ("http", None, "https", ("127.0.0.1",), False),
        ("http", "not-an-address", "https", ("127.0.0.1",), False),
    ],
)
def test_cookies_are_secure_over_https_or_behind_a_trusted_proxy_that_says_so(
    scheme: str, peer: str | None, proto: str, proxies: tuple[str, ...], secure: bool
) -> None:
    assert se.reached_over_https(scheme, peer, proto, se.trusted_networks(proxies)) is secure


# ---- request charts, from a real meter ----------------------------------------------------------


def _finished(n: int, *, duration_ms: float, ttft_ms: float | None, status: str = "ok") -> UsageRecord:
    return UsageRecord(
        request_id=f"r{n}",
        workload_id=None,
        api=Api.OPENAI,
        tenant=TenantId("acme"),
        key_id=ADMIN,
        capability=Capability.CHAT,
        alias="chat" if n % 2 else "embed",
        model="tiny",
        model_version="v1",
        deployment="d1",
        node_id="n1",
        status=status,
        prompt_tokens=3,
        completion_tokens=4,
        queue_ms=0.0,
        ttft_ms=ttft_ms,
        duration_ms=duration_ms,
        finished_at=time.time(),
    )


@pytest.fixture
async def meter(tmp_path: Path) -> AsyncIterator[tuple[Meter, Metrics]]:
    metrics = Metrics()
    async with st.open_store(tmp_path / "state") as store:
        yield Meter(GatewayConfig(), store, metrics), metrics


async def test_the_meters_statistics_count_what_its_histograms_count(meter: tuple[Meter, Metrics]) -> None:
    m, metrics = meter
    empty = m.statistics()
    assert (empty.requests, empty.errors, empty.bounds_s) == (0, 0, LATENCY_BOUNDS_S)
    assert set(empty.duration) == {0} and set(empty.ttft) == {0}
    for n, ms in enumerate((3.0, 40.0, 250.0, 900.0, 400_000.0)):
        m.record(_finished(n, duration_ms=ms, ttft_ms=ms / 2 if n else None, status="ok" if n < 4 else "timeout"))
    stats = m.statistics()
    assert (stats.requests, stats.errors) == (5, 1)
    assert stats.bounds_s[-1] == math.inf
    histograms = {
        "nexa_gateway_request_duration_seconds_bucket": stats.duration,
        "nexa_gateway_time_to_first_token_seconds_bucket": stats.ttft,
    }
    for name, counts in histograms.items():
        for bound, count in zip(stats.bounds_s, counts, strict=True):
            le = "+Inf" if math.isinf(bound) else str(bound)
            scraped = [
                metrics.registry.get_sample_value(name, {"model": a, "le": le}) or 0.0 for a in ("chat", "embed")
            ]
            assert count == sum(scraped), (name, le)
    assert stats.duration[-1] == 5 and stats.ttft[-1] == 4  # one request produced no first token


async def test_the_charts_summary_and_series_come_from_the_meters_statistics(meter: tuple[Meter, Metrics]) -> None:
    m, _ = meter
    assert ch.RequestCharts(m).summary(60) == ch.Summary(rps=0.0, error_rate=None, p95_ms=None)  # one sample
    charts = ch.RequestCharts(m)
    start = trio.current_time()
    charts.sample(start - 5.0)
    for n in range(20):
        m.record(_finished(n, duration_ms=300.0, ttft_ms=30.0, status="ok" if n else "overloaded"))
    summary = charts.summary(60)
    assert summary.rps == pytest.approx(20 / (trio.current_time() - start + 5.0), rel=0.01)
    assert summary.error_rate == pytest.approx(1 / 20)
    # Nineteen of twenty in the (0.25 s, 0.5 s] bucket: 0.25 + 0.25 * 19/20 s.
    assert summary.p95_ms == pytest.approx(487.5)
    series = charts.series()
    assert set(series) == set(ch.SERIES_COLUMNS)
    assert all(len(column) == 1 for column in series.values())
    assert series["p50"][0] == pytest.approx(375.0)
    assert series["ttft50"][0] == pytest.approx(37.5)  # all in (0.025 s, 0.05 s]: 0.025 + 0.025 * 10/20 s
    assert series["t"][0] == pytest.approx(time.time(), abs=5)


def test_quantiles_of_a_bucket_increase() -> None:
    bounds = (0.1, 1.0, math.inf)
    assert ch.quantile_ms(bounds, (0, 0, 0), (0, 0, 0), 0.5) is None  # nothing finished
    assert ch.quantile_ms((), (), (), 0.5) is None
    assert ch.quantile_ms(bounds, (0, 0), (1, 1, 1), 0.5) is None  # a sample from other bounds
    assert ch.quantile_ms(bounds, (0, 0, 0), (10, 10, 10), 0.5) == pytest.approx(50.0)
    assert ch.quantile_ms(bounds, (5, 5, 5), (5, 15, 15), 0.5) == pytest.approx(550.0)
    assert ch.quantile_ms(bounds, (0, 0, 0), (0, 0, 4), 0.99) == pytest.approx(1000.0)  # beyond the last bound
